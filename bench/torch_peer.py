"""What the benchmarks' PyTorch peers share: Fashion-MNIST training images normalised as the C
benchmarks read them, timing a training step in windows, and running a peer's rank function
on --world processes (mp.spawn, rendezvous through MASTER_ADDR/MASTER_PORT) to get rank 0's
result."""
import gzip
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def load_images(n):
    path = os.path.join(os.environ.get("TD_FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist"),
                        "train-images-idx3-ubyte.gz")
    with gzip.open(path) as f:
        raw = f.read(16 + n * 784)[16:]
    x = torch.frombuffer(bytearray(raw), dtype=torch.uint8).float().div_(255)
    return ((x - 0.2860) / 0.3530).view(n, 1, 28, 28)


def time_windows(step, args):
    """args.warmup steps, then args.windows windows of args.iters steps, the ranks meeting at a
    barrier before each; returns each window's rate in samples per second over args.batch."""
    for _ in range(args.warmup):
        step()
    windows = []
    for _ in range(args.windows):
        if args.world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            step()
        windows.append(args.batch * args.iters / (time.perf_counter() - t0))
    return windows


def _worker(rank, run, args, queue):
    result = {}
    run(rank, args, result)
    if rank == 0:
        queue.put(result)


def run_ranks(run, args):
    """run(rank, args, result) on args.world processes; returns rank 0's result."""
    if args.world == 1:
        result = {}
        run(0, args, result)
        return result
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(run, args, queue), nprocs=args.world)
    return queue.get()
