"""The torch backend's rendezvous and waits, on the ranks this is started on (tandemrun
--nproc-per-node 2):

- the port rank 0 publishes for tandem's store is already listening when it is published, so
  no other process can take it between the choice and the use (rank 0 used to pick a free
  port, close it, and bind it again later). The group is made through a store that, when the
  address is set, connects to it;
- Work.wait(timeout) gives up after the timeout, as gloo's works do, while the other rank is
  still away (it used to wait as long as the group's timeout allowed), and a later wait()
  completes the call with the right sum.

Prints "FAIL <case>: <why>" per failed case and "rank R: P passed, F failed" on every rank,
and exits 1 on a failure."""
import datetime
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

import tandem_torch  # noqa: F401  (registers the backend)

FAILED, PASSED = [], []


class CheckingStore(dist.Store):
    """A TCPStore that tries to connect to tandem's store address as it is published."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.listening = None

    def set(self, key, value):
        if key.endswith("tandem/rendezvous"):
            host, port, _ = bytes(value).decode().split(" ")
            try:
                with socket.create_connection((host, int(port)), timeout=5):
                    self.listening = True
            except OSError as e:
                self.listening = "%s:%s: %s" % (host, port, e)
        return self.inner.set(key, value)

    def get(self, key):
        return self.inner.get(key)

    def add(self, key, value):
        return self.inner.add(key, value)

    def wait(self, keys, timeout=None):
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)


def report(name, ok, why=""):
    (PASSED if ok else FAILED).append(name)
    if not ok:
        print("FAIL %s: %s" % (name, why), flush=True)


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    inner = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          rank == 0, timeout=datetime.timedelta(seconds=60))
    store = CheckingStore(inner)
    dist.init_process_group("tandem", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    if rank == 0:
        report("published_port_is_listening", store.listening is True,
               "nothing listened when the address was published (%s)" % store.listening)

    # Rank 1 arrives 3 s late: rank 0's wait(0.3 s) gives up, a plain wait() then completes.
    t = torch.full((4,), float(rank + 1))
    if rank == 1:
        time.sleep(3)
    work = dist.all_reduce(t, async_op=True)
    if rank == 0:
        t0 = time.time()
        try:
            work.wait(datetime.timedelta(milliseconds=300))
            report("wait_gives_up_at_its_timeout", False,
                   "wait(300 ms) returned after %.1f s" % (time.time() - t0))
        except RuntimeError as e:
            took = time.time() - t0
            report("wait_gives_up_at_its_timeout",
                   took < 2.5 and "did not complete within 300 ms" in str(e),
                   "raised after %.1f s: %s" % (took, e))
    work.wait()
    report("a_later_wait_completes", t.tolist() == [3.0] * 4, "sum %s" % t.tolist())
    dist.destroy_process_group()
    print("rank %d: %d passed, %d failed" % (rank, len(PASSED), len(FAILED)), flush=True)
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
