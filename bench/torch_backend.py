"""PyTorch over gloo against PyTorch over tandem (the torch.distributed backend of
bindings/torch), in one run on --world processes: torch.distributed.all_reduce bus bandwidth
from 4 KB to 256 MB (f32 sum, in place; busbw = bytes / time * 2(n-1)/n, nccl-tests' measure),
then DistributedDataParallel training throughput (samples/s) of bench/train's CNN and MLP at a
global batch of 128, one thread per rank. Every rank has both groups (the default one gloo's,
a second over the same ranks tandem's), and the timed windows alternate between them, so load
from elsewhere on the machine falls on both alike; each figure is the median of the windows.

    /usr/bin/python3 bench/torch_backend.py [--world 2] [--windows 5] [--max-bytes N] [--json]

The module is taken from build/python (or $TD_PYTHON_DIR); make builds it where PyTorch's C++
headers are installed (sh scripts/deps.sh torch). --json prints one line per size
({"bench":"torch_allreduce",...}) and per model ({"bench":"torch_ddp",...}) instead of tables.
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.environ.get("TD_PYTHON_DIR", os.path.join(HERE, "..", "build", "python")))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from torch_peer import load_images, run_ranks  # noqa: E402
from train_torch import MODELS  # noqa: E402

BACKENDS = ("gloo", "tandem")


def alternating(windows, groups, timed):
    """timed(backend) -> seconds of one window; the windows alternate backends, and which one
    goes first alternates too. Returns {backend: [seconds per window]}."""
    out = {b: [] for b in BACKENDS}
    for w in range(windows):
        for b in (BACKENDS if w % 2 == 0 else BACKENDS[::-1]):
            dist.barrier(group=groups[b])
            t0 = time.perf_counter()
            timed(b)
            out[b].append(time.perf_counter() - t0)
    return out


def allreduce_sizes(max_bytes):
    n = 4096
    while n <= max_bytes:
        yield n
        n *= 4


def bench_allreduce(rank, args, groups, result):
    world = args.world
    factor = 2.0 * (world - 1) / world
    rows = []
    for nbytes in allreduce_sizes(args.max_bytes):
        t = torch.ones(nbytes // 4)
        iters = max(2, min(200, (32 << 20) // nbytes))
        for b in BACKENDS:  # warm-up: first touches, tandem's staging
            for _ in range(3):
                dist.all_reduce(t, group=groups[b])

        def timed(b):
            for _ in range(iters):
                dist.all_reduce(t, group=groups[b])

        secs = alternating(args.windows, groups, timed)
        row = {"bench": "torch_allreduce", "ranks": world, "bytes": nbytes}
        for b in BACKENDS:
            per = statistics.median(secs[b]) / iters
            row[b + "_us"] = round(per * 1e6, 2)
            row[b + "_busbw"] = round(nbytes / per / 1e9 * factor, 3)
        row["tandem_over_gloo"] = round(row["gloo_us"] / row["tandem_us"], 3)
        rows.append(row)
    result["allreduce"] = rows


def bench_ddp(rank, args, groups, result):
    rows = []
    local = args.batch // args.world
    x = load_images(args.batch)[rank * local:(rank + 1) * local].contiguous()
    y = torch.randint(0, 10, (local,), generator=torch.Generator().manual_seed(rank))
    for name in ("cnn", "mlp"):
        steps = {}
        for b in BACKENDS:
            torch.manual_seed(0)
            model = torch.nn.parallel.DistributedDataParallel(MODELS[name](),
                                                              process_group=groups[b])
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)

            def step(model=model, opt=opt):
                opt.zero_grad()
                F.nll_loss(model(x), y).backward()
                opt.step()
            steps[b] = step
            for _ in range(args.warmup):
                step()

        def timed(b):
            for _ in range(args.iters):
                steps[b]()

        secs = alternating(args.windows, groups, timed)
        row = {"bench": "torch_ddp", "model": name, "world": args.world, "batch": args.batch}
        for b in BACKENDS:
            row[b + "_samples_per_s"] = round(args.batch * args.iters / statistics.median(secs[b]),
                                              1)
        row["tandem_over_gloo"] = round(row["tandem_samples_per_s"] / row["gloo_samples_per_s"], 3)
        rows.append(row)
    result["ddp"] = rows


def run(rank, args, result):
    import tandem_torch  # noqa: F401  (registers "tandem")

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    groups = {"gloo": dist.group.WORLD, "tandem": dist.new_group(backend="tandem")}
    if "allreduce" in args.parts:
        bench_allreduce(rank, args, groups, result)
    if "ddp" in args.parts:
        bench_ddp(rank, args, groups, result)
    dist.destroy_process_group(groups["tandem"])
    dist.destroy_process_group()


def print_tables(result, args):
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "?")
    print("# PyTorch %s over gloo and over tandem, %d ranks, %s, median of %d windows"
          % (torch.__version__, args.world, cpu, args.windows))
    if result.get("allreduce"):
        print("#\n# torch.distributed.all_reduce, f32 sum in place; busbw = algbw * 2(n-1)/n (GB/s)")
        print("# %10s | %10s %8s | %10s %8s | %s" % ("size(B)", "gloo(us)", "busbw", "tandem(us)",
                                                   "busbw", "tandem/gloo"))
        for r in result["allreduce"]:
            print("  %10d | %10.1f %8.3f | %10.1f %8.3f | %6.2fx" % (
                r["bytes"], r["gloo_us"], r["gloo_busbw"], r["tandem_us"], r["tandem_busbw"],
                r["tandem_over_gloo"]))
    if result.get("ddp"):
        print("#\n# DistributedDataParallel, global batch %d, samples/s" % args.batch)
        print("# %6s | %10s | %10s | %s" % ("model", "gloo", "tandem", "tandem/gloo"))
        for r in result["ddp"]:
            print("  %6s | %10.1f | %10.1f | %6.2fx" % (r["model"], r["gloo_samples_per_s"],
                                                      r["tandem_samples_per_s"],
                                                      r["tandem_over_gloo"]))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--max-bytes", type=int, default=256 << 20)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--iters", type=int, default=10, help="DDP steps per window")
    p.add_argument("--warmup", type=int, default=5, help="DDP steps before timing")
    p.add_argument("--parts", default="allreduce,ddp", help="allreduce, ddp or both")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    args.parts = args.parts.split(",")
    result = run_ranks(run, args)
    if args.json:
        for row in result.get("allreduce", []) + result.get("ddp", []):
            print(json.dumps(row), flush=True)
    else:
        print_tables(result, args)


if __name__ == "__main__":
    main()
