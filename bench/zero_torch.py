"""PyTorch peer for bench/zero: the MLP of bench/train (784 -> 1024 -> 1024 -> 10) at global
batch 128 with AdamW, one thread per process, timed the same way (forward, backward and the
optimizer step per iteration, median of several timed windows after warm-up, in milliseconds per
step), under DistributedDataParallel over gloo ("ddp"), or DDP with the optimizer state sharded by
torch.distributed.optim.ZeroRedundancyOptimizer ("zero1", ZeRO stage 1: each rank steps its
parameters' share and broadcasts them). PyTorch 1.13's FullyShardedDataParallel does not import
under Debian's build (a dataclass error in torch.distributed._shard), so stages 2 and 3 have no
peer here.

Prints one JSON line: {"way", "world", "ms_per_step", "windows"}.
Run with Debian's interpreter: /usr/bin/python3 bench/zero_torch.py --way zero1 --world 2
"""
import argparse
import json
import statistics

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer

from torch_peer import load_images, run_ranks, time_windows


def run(rank, args, result):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(
        nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
        nn.Linear(1024, 10), nn.LogSoftmax(dim=1)))
    if args.way == "zero1":
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                      lr=1e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    local = args.batch // args.world
    x = load_images(args.batch)[rank * local:(rank + 1) * local].contiguous()
    y = torch.randint(0, 10, (local,))

    def step():
        opt.zero_grad()
        F.nll_loss(model(x), y).backward()
        opt.step()

    rates = time_windows(step, args)  # samples/s over args.batch
    ms = [1000.0 * args.batch / r for r in rates]
    if rank == 0:
        result.update(way=args.way, world=args.world, ms_per_step=statistics.median(ms),
                      windows=ms)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--way", choices=["ddp", "zero1"], required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    result = run_ranks(run, args)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
