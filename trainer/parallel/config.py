"""The ``parallel`` config section: how the model is split (sizes) and how steps are scheduled."""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("1f1b", "afab")


@dataclass(frozen=True)
class ParallelConfig:
    """Layout choices; the data-parallel size is whatever the world leaves: world / (tp · pp)."""

    tp_size: int = 1
    """Tensor-parallel ranks per layer (keep within a node: it all-reduces every layer)."""
    pp_size: int = 1
    """Pipeline stages; model.num_layers must divide evenly."""
    sequence_parallel: bool = False
    """Shard LayerNorm/dropout regions on the sequence dim across the TP group (needs tp_size > 1 to
    matter; seq_length must divide by tp_size). Saves activation memory; same math."""
    schedule: str = "1f1b"
    """Pipeline schedule: '1f1b' (one-forward-one-backward) or 'afab' (all forward, all backward)."""
    bucket_size_mb: float = 25.0
    """Data-parallel gradient all-reduce bucket size (MiB of gradients)."""
    overlap_grad_reduce: bool = True
    """Launch each bucket's all-reduce from backward hooks as soon as its gradients are final."""

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name}={getattr(self, name)} must be >= 1")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"parallel.schedule={self.schedule!r} is not one of {SCHEDULES}")
        if self.bucket_size_mb <= 0:
            raise ValueError(f"parallel.bucket_size_mb={self.bucket_size_mb} must be > 0")


def num_microbatches(global_batch_size: int, micro_batch_size: int, dp_size: int) -> int:
    """Micro-batches per step on each rank: global_batch / (micro_batch · dp), which must be whole."""
    per_step = micro_batch_size * dp_size
    if micro_batch_size < 1 or global_batch_size % per_step:
        raise ValueError(f"train.global_batch_size={global_batch_size} is not a multiple of "
                         f"train.micro_batch_size={micro_batch_size} × dp_size={dp_size} (= {per_step}); "
                         f"pick one that is, e.g. {max(1, global_batch_size // per_step) * per_step}")
    return global_batch_size // per_step
