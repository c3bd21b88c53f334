"""Every collective of torch.distributed through the tandem backend against the same call
through gloo, on the ranks this is started on (tandemrun --nproc-per-node N). The default
group is gloo's; a second group over the same ranks is tandem's, so each call runs on both
with the same inputs and the results must agree: exactly where no arithmetic is involved,
within float rounding (a different summation order) where there is.

Prints "FAIL <case>: <why>" per failed case and "rank R: P passed, F failed" on every rank,
and exits 1 on a failure."""
import os
import sys

import torch
import torch.distributed as dist

import tandem_torch  # noqa: F401  (registers the backend)

PASSED, FAILED = [], []


def report(name, ok, why=""):
    if ok:
        PASSED.append(name)
    else:
        print("FAIL %s: %s" % (name, why), flush=True)
        FAILED.append(name)


def same(a, b, exact):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False, "dtype/shape %s %s vs %s %s" % (a.dtype, tuple(a.shape), b.dtype, tuple(b.shape))
    if exact or not a.is_floating_point():
        ok = torch.equal(a, b)
        return ok, "" if ok else "differ: %s vs %s" % (a.flatten()[:6].tolist(), b.flatten()[:6].tolist())
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-2, torch.float16: 2e-3}[a.dtype]
    err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    scale = max(1.0, b.double().abs().max().item() if b.numel() else 0.0)
    return err <= tol * scale, "max error %g (tol %g)" % (err, tol * scale)


def data(rank, n, dtype, salt=0):
    """Values that differ by rank and element; small integers so that every op is exact in the
    integer dtypes and PROD does not overflow."""
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype.is_floating_point:
        return (torch.rand(n, generator=g, dtype=torch.float64) * 2 + 0.5).to(dtype)
    return torch.randint(1, 4, (n,), generator=g).to(dtype)


def run_both(name, fn, exact=True, empty=False):
    """fn(group) returns a list of result tensors; the two backends' lists must agree. With
    empty tensors gloo's gathers divide by zero, so there tandem's call must just succeed."""
    try:
        got = fn(tandem)
        if empty:
            report(name, all(t.numel() == 0 for t in got), "results not empty")
            return
        want = fn(gloo)
    except Exception as e:  # a failure here is a failed case, the rest still runs
        report(name, False, "%s: %s" % (type(e).__name__, e))
        return
    for i, (a, b) in enumerate(zip(got, want)):
        ok, why = same(a, b, exact)
        if not ok:
            report(name, False, "result %d: %s" % (i, why))
            return
    report(name, len(got) == len(want), "result counts %d vs %d" % (len(got), len(want)))


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
gloo = dist.group.WORLD
tandem = dist.new_group(backend="tandem")
report("backend name", dist.get_backend(tandem) == "tandem", dist.get_backend(tandem))

SIZES = [0, 1, 7, 1000, 65536 + 3]
REDUCE_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32,
                 torch.int64, torch.uint8]
OPS = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
       "max": dist.ReduceOp.MAX}

for dtype in REDUCE_DTYPES:
    for opname, op in OPS.items():
        for n in SIZES:
            if dtype == torch.uint8 and opname in ("sum", "product") and n > 7:
                continue  # uint8 wraps differently nowhere, but keep the sums small

            def allreduce(g, dtype=dtype, op=op, n=n):
                # gloo reduces no bfloat16: its side reduces the same values in float64
                wide = g is gloo and dtype == torch.bfloat16
                t = data(rank, n, dtype).double() if wide else data(rank, n, dtype)
                dist.all_reduce(t, op=op, group=g)
                return [t.to(dtype)]
            # Sums and products of floats depend on the order ranks are added in.
            run_both("all_reduce %s %s n=%d" % (str(dtype)[6:], opname, n), allreduce,
                     exact=opname in ("min", "max"))


# AVG: gloo has none, so against the sum divided by the world.
for dtype in [torch.float32, torch.float64, torch.bfloat16]:
    t = data(rank, 1001, dtype)
    want = t.to(torch.float64, copy=True)
    dist.all_reduce(want, group=gloo)
    want = (want / world).to(dtype)
    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=tandem)
    ok, why = same(t, want, False)
    report("all_reduce %s avg" % str(dtype)[6:], ok, why)

for n in SIZES:
    for root in range(world):
        def broadcast(g, n=n, root=root):
            t = data(rank, n, torch.float32)
            dist.broadcast(t, root, group=g)
            return [t]
        run_both("broadcast n=%d root=%d" % (n, root), broadcast)

        def reduce(g, n=n, root=root):
            t = data(rank, n, torch.float64)
            dist.reduce(t, root, group=g)
            return [t] if rank == root else []
        run_both("reduce n=%d root=%d" % (n, root), reduce, exact=False)

# Dtypes tandem has no name for travel as bytes.
for dtype in [torch.bool, torch.int8, torch.int16, torch.complex64, torch.float32]:
    def bytes_for(g, t):
        """gloo moves none of these dtypes: its side moves the same bytes as uint8."""
        return t.view(torch.uint8) if g is gloo and dtype != torch.float32 else t

    def bcast_any(g, dtype=dtype):
        t = data(rank, 33, torch.float32).to(dtype) if dtype != torch.bool else \
            torch.arange(33) % (rank + 2) == 0
        dist.broadcast(bytes_for(g, t), 1 % world, group=g)
        return [t]
    run_both("broadcast %s" % str(dtype)[6:], bcast_any)

    def allgather_any(g, dtype=dtype):
        t = (data(rank, 5, torch.float32) * 10).to(dtype)
        outs = [torch.zeros(5, dtype=dtype) for _ in range(world)]
        dist.all_gather([bytes_for(g, o) for o in outs], bytes_for(g, t), group=g)
        return outs
    run_both("all_gather %s" % str(dtype)[6:], allgather_any)

for n in [0, 1, 1000]:
    def all_gather(g, n=n):
        outs = [torch.zeros(n, 2) for _ in range(world)]
        dist.all_gather(outs, data(rank, 2 * n, torch.float32).view(n, 2), group=g)
        return outs
    run_both("all_gather n=%d" % n, all_gather, empty=n == 0)

    # gloo in 1.13 has no _allgather_base, reduce_scatter or list all_to_all: its side of
    # those is built from what it has.
    def all_gather_into_tensor(g, n=n):
        out = torch.zeros(world * n, dtype=torch.int64)
        if g is tandem:
            dist.all_gather_into_tensor(out, data(rank, n, torch.int64), group=g)
        else:
            dist.all_gather(list(out.chunk(world)), data(rank, n, torch.int64), group=g)
        return [out]
    run_both("all_gather_into_tensor n=%d" % n, all_gather_into_tensor, empty=n == 0)

    for root in range(world):
        def gather(g, n=n, root=root):
            outs = [torch.zeros(n) for _ in range(world)] if rank == root else None
            dist.gather(data(rank, n, torch.float32), outs, dst=root, group=g)
            return outs or []
        run_both("gather n=%d root=%d" % (n, root), gather, empty=n == 0)

        def scatter(g, n=n, root=root):
            out = torch.zeros(n)
            ins = [data(r, n, torch.float32, salt=7) * (rank + 1) for r in range(world)] \
                if rank == root else None
            dist.scatter(out, ins, src=root, group=g)
            return [out]
        run_both("scatter n=%d root=%d" % (n, root), scatter, empty=n == 0)

    def reduce_scatter(g, n=n):
        out = torch.zeros(n)
        ins = [data(rank, n, torch.float32, salt=r) for r in range(world)]
        if g is tandem:
            dist.reduce_scatter(out, ins, group=g)
        else:
            whole = torch.cat(ins)
            dist.all_reduce(whole, group=g)
            out = whole.chunk(world)[rank].clone()
        return [out]
    run_both("reduce_scatter n=%d" % n, reduce_scatter, exact=False, empty=n == 0)

    def reduce_scatter_tensor(g, n=n):
        out = torch.zeros(n, dtype=torch.float64)
        whole = data(rank, world * n, torch.float64)
        if g is tandem:
            dist.reduce_scatter_tensor(out, whole, group=g)
        else:
            dist.all_reduce(whole, group=g)
            out = whole.chunk(world)[rank].clone()
        return [out]
    run_both("reduce_scatter_tensor n=%d" % n, reduce_scatter_tensor, exact=False,
             empty=n == 0)

    def all_to_all_single(g, n=n):
        out = torch.zeros(world * n)
        dist.all_to_all_single(out, data(rank, world * n, torch.float32), group=g)
        return [out]
    run_both("all_to_all_single n=%d" % n, all_to_all_single, empty=n == 0)

    def all_to_all(g, n=n):
        outs = [torch.zeros(n, dtype=torch.int32) for _ in range(world)]
        ins = [data(rank, n, torch.int32, salt=r) for r in range(world)]
        if g is tandem:
            dist.all_to_all(outs, ins, group=g)
        else:
            out = torch.zeros(world * n, dtype=torch.int32)
            dist.all_to_all_single(out, torch.cat(ins), group=g)
            outs = list(out.chunk(world))
        return outs
    run_both("all_to_all n=%d" % n, all_to_all, empty=n == 0)

    def all_reduce_coalesced(g, n=n):
        ts = [data(rank, n, torch.float64), data(rank, 3, torch.float64, salt=1).view(3, 1)]
        dist.all_reduce_coalesced(ts, group=g)
        return ts
    run_both("all_reduce_coalesced n=%d" % n, all_reduce_coalesced, exact=False)


def ring(g):
    """Each rank sends to the next and receives from the one before (send, recv, isend,
    irecv), with a message to itself too."""
    out = []
    for i, tag in enumerate([0, 5]):
        send = data(rank, 100 + i, torch.float32)
        recv = torch.zeros(100 + i)
        if i == 0:
            sreq = dist.isend(send, (rank + 1) % world, group=g, tag=tag)
            dist.recv(recv, (rank - 1) % world, group=g, tag=tag)
            sreq.wait()
        else:
            rreq = dist.irecv(recv, (rank - 1) % world, group=g, tag=tag)
            dist.send(send, (rank + 1) % world, group=g, tag=tag)
            rreq.wait()
        out.append(recv)
    return out


run_both("send/recv ring", ring)


def barrier_then_async(g):
    dist.barrier(group=g)
    t = data(rank, 4096, torch.float32)
    u = data(rank, 17, torch.int64)
    w1 = dist.all_reduce(t, group=g, async_op=True)
    w2 = dist.all_reduce(u, op=dist.ReduceOp.MAX, group=g, async_op=True)
    w2.wait()
    w1.wait()
    return [t, u]


run_both("barrier + async all_reduce", barrier_then_async, exact=False)


def future(g):
    """What DDP does: the future of a work completes without a wait on the work."""
    t = data(rank, 5000, torch.float32)
    fut = dist.all_reduce(t, group=g, async_op=True).get_future()
    return [fut.wait()[0]]


run_both("all_reduce future", future, exact=False)

# Refused arguments name the call and what is wrong, as exceptions.
for what, fn, says in [
    ("non-contiguous", lambda: dist.all_reduce(torch.zeros(4, 4).t(), group=tandem),
     "not contiguous"),
    ("bool sum", lambda: dist.all_reduce(torch.zeros(4, dtype=torch.bool), group=tandem),
     "cannot reduce"),
    ("bitwise and", lambda: dist.all_reduce(torch.zeros(4, dtype=torch.int32),
                                            op=dist.ReduceOp.BAND, group=tandem),
     "reduce op"),
    ("uneven all_to_all",
     lambda: dist.all_to_all_single(torch.zeros(2 * world), torch.zeros(2 * world),
                                    [2 * world] + [0] * (world - 1),
                                    [2 * world] + [0] * (world - 1), group=tandem),
     "uneven splits"),
]:
    try:
        fn()
        report("refuses " + what, False, "no exception")
    except RuntimeError as e:
        report("refuses " + what, says in str(e) and "tandem" in str(e), str(e))

# The group still works after refused calls.
run_both("all_reduce after refusals", lambda g: [dist.all_reduce(t := data(rank, 9, torch.float64), group=g) or t],
         exact=False)

dist.destroy_process_group(tandem)
dist.destroy_process_group()
print("rank %d: %d passed, %d failed" % (rank, len(PASSED), len(FAILED)), flush=True)
sys.exit(1 if FAILED else 0)
