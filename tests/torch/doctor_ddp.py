"""A PyTorch DistributedDataParallel job on the tandem backend in which rank 1 skips a step: its
gradients' all-reduces run one step ahead of rank 0's, and its closing barrier meets rank 0's
last all-reduce. Run under tandemrun (tests/test_doctor.c does), the hang doctor names rank 1,
the step it skipped and PyTorch's all_reduce. Each step is marked with tandem_torch.mark_step,
as a training loop would."""
import datetime
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import tandem_torch


def main():
    timeout = float(sys.argv[1]) if len(sys.argv) > 1 else 5.0
    dist.init_process_group("tandem", timeout=datetime.timedelta(seconds=timeout))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 32)
    for step in range(6):
        tandem_torch.mark_step(step)
        if rank == 1 and step == 3:
            print("fault-at %.6f %.6f" % (time.monotonic(), time.time()), flush=True)
            continue
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    dist.barrier()


if __name__ == "__main__":
    main()
