"""PyTorch peer for bench/contrastive's throughput rows: examples/contrastive's SimCLR network
(three conv 3x3 + batch norm + ReLU of 32, 64, 128 channels, max pools, global average pool,
head 128 -> 128 -> 64, L2-normalised) and NT-Xent at temperature 0.2, trained with SGD under
DistributedDataParallel over gloo, one thread per process. Global negatives gather every rank's
features with torch.distributed.nn.functional.all_gather (differentiable); local ones use the
rank's own. Batch norm is plain nn.BatchNorm2d: this PyTorch's nn.SyncBatchNorm runs on CUDA
only. The views are two noisy copies of Fashion-MNIST images made once, so the timed loop is
forward + backward + step, median of several timed windows after warm-up.

Prints one JSON line: {"negatives", "world", "images_per_s", "windows"}.
Run with Debian's interpreter: /usr/bin/python3 bench/contrastive_torch.py --world 2
"""
import argparse
import json
import statistics

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn
import torch.nn as nn
import torch.nn.functional as F

from torch_peer import load_images, run_ranks, time_windows


def block(cin, cout):
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]


class SimCLR(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(*block(1, 32), nn.MaxPool2d(2), *block(32, 64),
                                     nn.MaxPool2d(2), *block(64, 128), nn.AvgPool2d(7),
                                     nn.Flatten())
        self.head = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 64))

    def forward(self, x):
        return F.normalize(self.head(self.encoder(x)), dim=1)


def nt_xent(z, keys, first, temperature):
    """Anchor i of z (2n, D) against every key but itself; target: its other view."""
    n2 = z.shape[0]
    logits = z @ keys.t() / temperature
    rows = torch.arange(n2)
    logits[rows, first + rows] = -1e9
    target = first + (rows + n2 // 2) % n2
    return F.cross_entropy(logits, target)


def run(rank, args, result):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=args.world)
    model = SimCLR()
    if args.world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    n = args.batch // args.world
    images = load_images(args.batch)[rank * n:(rank + 1) * n]
    views = torch.cat([images + 0.1 * torch.randn_like(images),
                       images + 0.1 * torch.randn_like(images)]).contiguous()
    model.train()

    def step():
        opt.zero_grad()
        z = model(views)
        if args.negatives == "global" and args.world > 1:
            loss = nt_xent(z, torch.cat(dnn.all_gather(z)), rank * 2 * n, args.temperature)
        else:
            loss = nt_xent(z, z, 0, args.temperature)
        loss.backward()
        opt.step()

    windows = time_windows(step, args)
    if rank == 0:
        result.update(negatives=args.negatives, world=args.world,
                      images_per_s=statistics.median(windows), windows=windows)
    if args.world > 1:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--negatives", choices=["global", "local"], default="global")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    result = run_ranks(run, args)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
