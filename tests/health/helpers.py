"""Real gloo worlds for the health tests, joined without waiting out torch's 30 s kill grace period (a
rank that SIGSTOPped itself never ends on SIGTERM)."""

from __future__ import annotations

import multiprocessing
import os

import torch.multiprocessing as mp

from tests.train.harness import _worker


def launch(world: int, store_dir: str, fn, *args) -> None:
    """Run ``fn(rank, *args)`` on ``world`` gloo processes; raises like ``mp.spawn`` when one fails,
    killing the rest after one second."""
    multiprocessing.set_forkserver_preload(["torch", "trainer.main", "tests.train.harness"])
    store = os.path.join(store_dir, f"store-{os.getpid()}-{len(os.listdir(store_dir))}")
    ctx = mp.start_processes(_worker, args=(world, store, fn, args), nprocs=world, start_method="forkserver",
                             join=False)
    while not ctx.join(grace_period=1.0):
        pass
