"""PyTorch peer for bench/train: the same three models, batch and optimizer, one thread per
process (--threads N: N), timed the same way (forward + backward + SGD step per iteration, median of
several timed windows after warm-up). World size 2 runs DistributedDataParallel over gloo
with the global batch split across ranks, as the C side does. --autocast bf16 runs forward
and loss under torch.autocast("cpu", dtype=torch.bfloat16), PyTorch's mixed precision on CPU.

Prints one JSON line: {"model", "world", "samples_per_s", "windows"}.
Run with Debian's interpreter: /usr/bin/python3 bench/train_torch.py --model net --world 2
"""
import argparse
import json
import statistics

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from torch_peer import load_images, run_ranks, time_windows


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


def run(rank, args, result):
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=args.world)
    model = MODELS[args.model]()
    if args.world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
    local = args.batch // args.world
    x = load_images(args.batch)[rank * local:(rank + 1) * local].contiguous()
    y = torch.randint(0, 10, (local,))
    model.train()

    def step():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast == "bf16"):
            loss = F.nll_loss(model(x), y)
        loss.backward()
        opt.step()

    windows = time_windows(step, args)
    if rank == 0:
        result.update(model=args.model, world=args.world, samples_per_s=statistics.median(windows),
                      windows=windows)
    if args.world > 1:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(MODELS), required=True)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--autocast", choices=["none", "bf16"], default="none")
    args = p.parse_args()
    result = run_ranks(run, args)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
