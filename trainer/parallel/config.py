"""The ``parallel`` config section (defined in :mod:`trainer.config.model`) and the micro-batch rule."""

from __future__ import annotations

from trainer.config.model import SCHEDULES, ParallelConfig

# The section itself is defined once, torch-free, with the other config sections.
__all__ = ["SCHEDULES", "ParallelConfig", "num_microbatches"]


def num_microbatches(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    """Micro-batches per step on each rank: global_batch / (micro_batch · dp), which must be whole."""
    per_step = micro_batch_size * dp_size
    if micro_batch_size < 1 or global_batch_size % per_step:
        raise ValueError(f"train.global_batch_size={global_batch_size} is not a multiple of "
                         f"train.micro_batch_size={micro_batch_size} × dp_size={dp_size} (= {per_step}); "
                         f"pick one that is, e.g. {max(1, global_batch_size // per_step) * per_step}")
    return global_batch_size // per_step
