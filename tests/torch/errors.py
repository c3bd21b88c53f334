"""A rank that calls a different collective, or dies, surfaces on every other rank of a tandem
process group as a Python exception naming that rank and the call, within the group's
timeout, and a later call on the group fails at once with the same story; the same when the
rank dies in the middle of DistributedDataParallel training, whose bucket all-reduces complete
through futures.

Without arguments this starts its own ranks (a launcher would stop the survivors of a dead
rank before they could report) for each case, and checks what each rank printed. Prints
"ok <case>" or "FAIL <case>: <why>" and exits 1 on a failure."""
import datetime
import os
import socket
import subprocess
import sys
import time

TIMEOUT = 20  # the groups' timeout, seconds: every case must end well within it

CASES = {
    # case: (world, the dead or odd rank, words every other rank's exception must hold)
    "mismatch": (3, 1, ["rank 1 called broadcast #", "allreduce #"]),
    "dead": (3, 1, ["rank 1", "died"]),
    "ddp_dead": (2, 1, ["rank 1", "died"]),
}


def rank_main(case):
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import tandem_torch  # noqa: F401

    dist.init_process_group("tandem", timeout=datetime.timedelta(seconds=TIMEOUT))
    rank = dist.get_rank()
    t = torch.ones(1000)
    dist.all_reduce(t)
    t0 = time.time()
    try:
        if case == "mismatch":
            if rank == 1:
                dist.broadcast(t, 0)
            else:
                dist.all_reduce(t)
        elif case == "dead":
            if rank == 1:
                os._exit(3)
            dist.all_reduce(t)
        elif case == "ddp_dead":
            torch.manual_seed(0)
            model = nn.parallel.DistributedDataParallel(
                nn.Sequential(nn.Linear(100, 200), nn.ReLU(), nn.Linear(200, 10)))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            x = torch.randn(32, 100)
            for step in range(20):
                if rank == 1 and step == 3:
                    os._exit(3)
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
        print("rank %d: no exception" % rank, flush=True)
    except RuntimeError as e:
        print("rank %d: raised after %.1f s: %s" % (rank, time.time() - t0,
                                                    str(e).splitlines()[0]), flush=True)
    try:
        dist.all_reduce(t)
        print("rank %d: later call: no exception" % rank, flush=True)
    except RuntimeError as e:
        print("rank %d: later call raised: %s" % (rank, str(e).splitlines()[0]), flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check(case):
    world, odd, words = CASES[case]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, case],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    t0 = time.time()
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=3 * TIMEOUT)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0] + "\n(hung)")
    took = time.time() - t0
    why = []
    for r, out in enumerate(outs):
        if case != "mismatch" and r == odd:
            continue  # it died
        first = [ln for ln in out.splitlines() if ln.startswith("rank %d: raised" % r)]
        later = [ln for ln in out.splitlines() if ln.startswith("rank %d: later call raised" % r)]
        missing = [w for w in words if not first or w not in first[0]]
        if not first or missing or "tandem" not in first[0]:
            why.append("rank %d did not raise naming %s:\n%s" % (r, missing or words, out))
        elif float(first[0].split("after ")[1].split(" s")[0]) > TIMEOUT:
            why.append("rank %d raised only after the timeout: %s" % (r, first[0]))
        elif not later or (words[0] not in later[0]):
            why.append("rank %d: a later call did not fail with the same story:\n%s" % (r, out))
    print(("ok   %s (%.1f s)" % (case, took)) if not why else
          "FAIL %s: %s" % (case, "\n".join(why)), flush=True)
    return not why


if __name__ == "__main__":
    if len(sys.argv) > 1:
        rank_main(sys.argv[1])
    else:
        failed = [c for c in CASES if not check(c)]
        print("%d failed" % len(failed), flush=True)
        sys.exit(1 if failed else 0)
