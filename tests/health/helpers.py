"""Real gloo worlds for the health tests, joined without waiting out torch's 30 s kill grace period (a
rank that SIGSTOPped itself never ends on SIGTERM)."""

from __future__ import annotations

import multiprocessing
import os
import threading

import torch.multiprocessing as mp

from tests.train.harness import _worker
from tests.waits import NEVER_S


def launch(world: int, store_dir: str, fn, *args) -> None:
    """Run ``fn(rank, *args)`` on ``world`` gloo processes; raises like ``mp.spawn`` when one fails,
    killing the rest after one second."""
    multiprocessing.set_forkserver_preload(["torch", "trainer.run", "tests.train.harness"])
    store = os.path.join(store_dir, f"store-{os.getpid()}-{len(os.listdir(store_dir))}")
    ctx = mp.start_processes(_worker, args=(world, store, fn, args), nprocs=world, start_method="forkserver",
                             join=False)
    while not ctx.join(grace_period=1.0):
        pass


class VirtualClock:
    """The watchdog's progress clock (``Monitor.clock``) as a test drives it: time passes only when the test
    says so, so "this phase outlasted hang_timeout_s" is a fact the test sets, never a race with how fast
    a loaded machine runs. Install it in the process whose monitor it drives (a launched rank).

    ``advance`` returns only once the watchdog thread has read the clock twice since: its loop reads it for
    the idle check and again for a heartbeat's record, so two reads include at least one idle check. A
    phase the watchdog should take for a hang is therefore always seen as one."""

    def __init__(self) -> None:
        self.now = 1000.0
        self._owner = threading.get_ident()
        self._reads = 0
        self._read = threading.Condition()

    def __call__(self) -> float:
        if threading.get_ident() != self._owner:
            with self._read:
                self._reads += 1
                self._read.notify_all()
        return self.now

    def advance(self, seconds: float) -> None:
        with self._read:
            self.now += seconds
            seen = self._reads
            assert self._read.wait_for(lambda: self._reads >= seen + 2, NEVER_S), "the watchdog never looked"

    def install(self) -> VirtualClock:
        from trainer.health import Monitor

        Monitor.clock = self  # not a function: read from the instance without binding
        return self
