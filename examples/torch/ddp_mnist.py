"""PyTorch's DistributedDataParallel recipe (mp.spawn, DistributedSampler, DDP) on tandem's
collectives: the Net of PyTorch's MNIST example (or the MLP or CNN of bench/train) on
Fashion-MNIST, a DistributedSampler shard per rank, SGD with momentum, one process per rank. The
only change from a gloo program is the backend's name (and the import that registers it):

    import tandem_torch
    dist.init_process_group("tandem")

Run it under a launcher that sets torchrun's env contract (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT); Debian's torchrun 1.13 does not start under Python 3.11, tandemrun does:

    PYTHONPATH=build/python build/bin/tandemrun --nproc-per-node 2 \\
        /usr/bin/python3 examples/torch/ddp_mnist.py --epochs 1

--backend gloo runs the same program over PyTorch's own backend; --save PATH writes rank 0's
parameters (torch.save of the state_dict) after training, to compare the two by.
"""
import argparse
import gzip
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Net(nn.Module):
    """The Net of PyTorch's MNIST example."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                         nn.ReLU(), nn.Linear(1024, 10), nn.LogSoftmax(dim=1))


def cnn():
    def block(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]
    return nn.Sequential(*block(1, 32), *block(32, 32), nn.MaxPool2d(2), *block(32, 64),
                         *block(64, 64), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(3136, 10),
                         nn.LogSoftmax(dim=1))


MODELS = {"net": Net, "mlp": mlp, "cnn": cnn}


def idx(path):
    """An IDX file (gzip) as a numpy array."""
    with gzip.open(path) as f:
        raw = f.read()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def fashion_mnist(data_dir, split):
    images = idx(os.path.join(data_dir, split + "-images-idx3-ubyte.gz"))
    labels = idx(os.path.join(data_dir, split + "-labels-idx1-ubyte.gz"))
    x = torch.from_numpy(images.copy()).float().div_(255).sub_(0.2860).div_(0.3530)
    return TensorDataset(x.unsqueeze(1), torch.from_numpy(labels.astype(np.int64)))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="tandem", help="tandem (default) or gloo")
    p.add_argument("--model", choices=sorted(MODELS), default="net")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=0, help="stop after N optimizer steps")
    p.add_argument("--batch", type=int, default=128, help="global batch")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--data", default=os.environ.get("TD_FASHION_MNIST_DIR",
                                                    "/usr/share/datasets/fashion-mnist"))
    p.add_argument("--save", help="write rank 0's parameters here after training")
    args = p.parse_args()

    if args.backend == "tandem":
        import tandem_torch  # noqa: F401  (registers the backend "tandem")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    model = DistributedDataParallel(MODELS[args.model]())
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    train = fashion_mnist(args.data, "train")
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, seed=args.seed)
    loader = DataLoader(train, batch_size=args.batch // world, sampler=sampler, drop_last=True)

    steps, t0 = 0, time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            opt.zero_grad()
            loss = F.nll_loss(model(x), y)
            loss.backward()
            opt.step()
            steps += 1
            if rank == 0 and steps % 100 == 0:
                print("epoch %d step %d loss %.4f" % (epoch + 1, steps, loss.item()), flush=True)
            if steps == args.max_steps:
                break
        if steps == args.max_steps:
            break
    secs = time.perf_counter() - t0
    if rank == 0:
        print("%s: %d steps on %d ranks in %.1f s (%.0f samples/s), last loss %.4f" %
              (args.backend, steps, world, secs, steps * args.batch / secs, loss.item()),
              flush=True)
        if args.save:
            torch.save(model.module.state_dict(), args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
