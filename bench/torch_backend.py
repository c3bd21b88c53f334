"""PyTorch over gloo against PyTorch over tandem (the torch.distributed backend of
bindings/torch), in one run on --world processes: torch.distributed.all_reduce bus bandwidth
from 4 KB to 256 MB (f32 sum, in place; busbw = bytes / time * 2(n-1)/n, nccl-tests' measure),
then DistributedDataParallel training throughput (samples/s) of bench/train's CNN and MLP at a
global batch of 128, one thread per rank, beside the same ranks training their halves with no
communication at all (the ceiling: what any backend could reach). Every rank has both groups
(the default one gloo's, a second over the same ranks tandem's). The timed windows run in
rounds, one window of each way back to back, so that load from elsewhere on the machine falls
on every way alike: each rate is the median over the rounds, and each ratio the median of the
rounds' ratios (load that comes and goes over minutes moves a round's windows together).

    /usr/bin/python3 bench/torch_backend.py [--world 2] [--windows 15] [--max-bytes N] [--json]

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


def alternating(windows, groups, timed, ways=BACKENDS):
    """timed(way) -> seconds of one window. Each round runs one window of every way back to
    back, which one goes first alternating, the ranks meeting at a barrier of the way's group
    (tandem's for a way without one) before each. Returns {way: [seconds per round]}."""
    out = {b: [] for b in ways}
    for w in range(windows):
        for b in (ways if w % 2 == 0 else ways[::-1]):
            dist.barrier(group=groups.get(b, groups["tandem"]))
            t0 = time.perf_counter()
            timed(b)
            out[b].append(time.perf_counter() - t0)
    return out


def round_ratio(secs, a, b):
    """The median over the rounds of a's speed over b's in the same round: load from elsewhere
    that comes and goes over minutes moves both windows of a round alike."""
    return statistics.median(sb / sa for sa, sb in zip(secs[a], secs[b]))


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
        row["tandem_over_gloo"] = round(round_ratio(secs, "tandem", "gloo"), 3)
        rows.append(row)
    result["allreduce"] = rows


def bench_ddp(rank, args, groups, result):
    rows = []
    local = args.batch // args.world
    x = load_images(args.batch)[rank * local:(rank + 1) * local].contiguous()
    y = torch.randint(0, 10, (local,), generator=torch.Generator().manual_seed(rank))
    ways = BACKENDS + ("none",)
    for name in ("cnn", "mlp"):
        steps = {}
        for b in ways:
            torch.manual_seed(0)
            model = MODELS[name]()
            if b != "none":  # "none": each rank on its half alone, the ceiling of DDP
                model = torch.nn.parallel.DistributedDataParallel(model, process_group=groups[b])
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)

            def step(model=model, opt=opt):
                opt.zero_grad()
                F.nll_loss(model(x), y).backward()
                opt.step()
            steps[b] = step
            for _ in range(args.warmup):
                step()

        # Steps per window: about args.window_s seconds of gloo's, the same on every rank.
        t0 = time.perf_counter()
        steps["gloo"]()
        took = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(took, op=dist.ReduceOp.MAX, group=groups["gloo"])
        iters = max(2, int(round(args.window_s / took.item())))

        def timed(b):
            for _ in range(iters):
                steps[b]()

        secs = alternating(args.windows, groups, timed, ways)
        row = {"bench": "torch_ddp", "model": name, "world": args.world, "batch": args.batch,
               "steps_per_window": iters}
        for b in ways:
            key = ("nocomm" if b == "none" else b) + "_samples_per_s"
            row[key] = round(args.batch * iters / statistics.median(secs[b]), 1)
        row["tandem_over_gloo"] = round(round_ratio(secs, "tandem", "gloo"), 3)
        row["nocomm_over_gloo"] = round(round_ratio(secs, "none", "gloo"), 3)
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
    print("# PyTorch %s over gloo and over tandem, %d ranks, %s, medians of %d rounds (ratios: "
          "medians of the rounds' ratios)" % (torch.__version__, args.world, cpu, args.windows))
    if result.get("allreduce"):
        print("#\n# torch.distributed.all_reduce, f32 sum in place; busbw = algbw * 2(n-1)/n (GB/s)")
        print("# %10s | %10s %8s | %10s %8s | %s" % ("size(B)", "gloo(us)", "busbw", "tandem(us)",
                                                   "busbw", "tandem/gloo"))
        for r in result["allreduce"]:
            print("  %10d | %10.1f %8.3f | %10.1f %8.3f | %6.2fx" % (
                r["bytes"], r["gloo_us"], r["gloo_busbw"], r["tandem_us"], r["tandem_busbw"],
                r["tandem_over_gloo"]))
    if result.get("ddp"):
        print("#\n# DistributedDataParallel, global batch %d, samples/s; no comm: each rank trains "
              "its half alone, the most DDP could reach" % args.batch)
        print("# %6s | %10s | %10s | %10s | %11s | %s" % ("model", "gloo", "tandem", "no comm",
                                                         "tandem/gloo", "no comm/gloo"))
        for r in result["ddp"]:
            print("  %6s | %10.1f | %10.1f | %10.1f | %10.2fx | %6.2fx" % (
                r["model"], r["gloo_samples_per_s"], r["tandem_samples_per_s"],
                r["nocomm_samples_per_s"], r["tandem_over_gloo"], r["nocomm_over_gloo"]))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--windows", type=int, default=15, help="rounds of one window per way")
    p.add_argument("--max-bytes", type=int, default=256 << 20)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--window-s", type=float, default=1.0,
                   help="DDP: seconds of a window, as steps of gloo's first timed step")
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
