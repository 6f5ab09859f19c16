"""A rank out of memory: one line with the allocator's words, the rank's layout and what to change.

The same model, micro-batch and parallel layout need the same memory on every attempt, so the error is
permanent (trainer.signals.out_of_memory: exit 78, the sbatch script does not retry it) and its message is
the job's reason in ``status``: the layout it ran and the fixes (a smaller micro-batch, activation
recomputation, more pipeline stages).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from trainer import health
from trainer.config import RunConfig
from trainer.signals import out_of_memory


class OutOfMemory(RuntimeError):
    """A rank ran out of memory: the allocator's words, the rank's layout and what to change (one line).
    ``allocator``: the allocator's own line alone (what layout=auto's trial table shows)."""

    def __init__(self, message: str, allocator: str) -> None:
        super().__init__(message)
        self.allocator = allocator


def oom_message(cfg: RunConfig, rank: int, world_size: int, iteration: int | None, what: str) -> str:
    """Why a rank ran out of memory and the fixes: the same layout needs the same memory on every
    attempt, so the job is not retried (trainer.signals.out_of_memory)."""
    t, p = cfg.train, cfg.parallel
    dp = max(world_size // max(p.tp_size * p.pp_size, 1), 1)
    layout = (f"tp={p.tp_size} pp={p.pp_size} dp={dp}, micro-batch {t.micro_batch_size}, sequence "
              f"{cfg.model.seq_length}, recompute {t.recompute_granularity}, {t.precision}")
    fixes = [f"a smaller train.micro_batch_size (now {t.micro_batch_size})"] if t.micro_batch_size > 1 else []
    if t.recompute_granularity != "full":
        fixes.append("activation recomputation (train.recompute_granularity=full)")
    fixes.append(f"more pipeline stages (parallel.pp_size above {p.pp_size})")
    at = "at start-up" if iteration is None else f"at iteration {iteration}"
    return (f"rank {rank} ran out of memory {at} with layout {layout}: {what}. The same layout needs the "
            f"same memory on every attempt, so it is not retried; use {', or '.join(fixes)}")


@contextmanager
def named(cfg: RunConfig, hb: health.Monitor) -> Iterator[None]:
    """An out-of-memory error leaves as :class:`OutOfMemory`, naming this rank's layout and the fixes (the
    heartbeat, the log and the stage's fatal marker carry that line)."""
    try:
        yield
    except Exception as e:
        what = out_of_memory(e)
        if what is None or isinstance(e, OutOfMemory):
            raise
        raise OutOfMemory(oom_message(cfg, hb.rank, hb.world_size, hb.iteration, what), what) from e
