"""Rank-aware logging for library code (house style: no print in library code).

Every record carries the global rank; by default only rank 0 emits INFO and below, all ranks emit
warnings and errors, so a 512-rank job does not write 512 copies of each log line.
"""

from __future__ import annotations

import logging
import os
import sys

_CONFIGURED = False


def global_rank() -> int:
    """The process's global rank from torch.distributed, torchrun or Slurm, else 0."""
    # Only a torch.distributed that is already imported can be initialized; importing torch here would
    # cost seconds on every CLI's first log line (e.g. the data tools, which never use torch).
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for key in ("RANK", "SLURM_PROCID"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


class _RankFilter(logging.Filter):
    def __init__(self, all_ranks: bool) -> None:
        super().__init__()
        self.all_ranks = all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        rank = global_rank()
        record.rank = rank
        return self.all_ranks or rank == 0 or record.levelno >= logging.WARNING


def setup_logging(level: str | int | None = None, all_ranks: bool = False) -> None:
    """Configure the ``slipway`` logger once: one stream handler on stderr with the rank in each line."""
    global _CONFIGURED
    root = logging.getLogger("slipway")
    if level is None:
        level = os.environ.get("SLIPWAY_LOG_LEVEL", "INFO")
    root.setLevel(level)
    if _CONFIGURED:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RankFilter(all_ranks))
    handler.setFormatter(logging.Formatter("[%(asctime)s rank%(rank)s %(levelname)s %(name)s] %(message)s",
                                           "%H:%M:%S"))
    root.addHandler(handler)
    root.propagate = False
    _CONFIGURED = True


def get_logger(name: str) -> logging.Logger:
    """A child of the ``slipway`` logger; ``name`` is usually ``__name__``."""
    setup_logging()
    return logging.getLogger("slipway." + name.removeprefix("slipway."))
