"""Megatron's ``OptimizerParamScheduler``: linear warm-up, then cosine/linear/constant decay to ``min_lr``.

Steps are counted in *samples*, not iterations (Megatron multiplies the iteration settings by the global
batch size and advances by the global batch size after each optimizer step), so changing the batch size
keeps the shape of the schedule over the data. Exactly as Megatron: the scheduler is stepped by 0 at
construction (so with warm-up, the first update uses lr = 0) and by ``global_batch_size`` after each
iteration, including skipped (fp16 overflow) ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trainer.log import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class LRSchedule:
    """Schedule settings in samples."""

    max_lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    decay_style: str
    init_lr: float = 0.0
    weight_decay: float = 0.0  # constant (Megatron's start_wd == end_wd)

    @classmethod
    def from_iters(cls, optim, iters: int, global_batch_size: int) -> LRSchedule:
        """From an ``OptimConfig`` slice: Megatron's ``lr_*_iters * global_batch_size``."""
        decay_iters = optim.decay_iters if optim.decay_iters is not None else iters
        return cls(max_lr=optim.lr, min_lr=optim.min_lr, warmup_steps=optim.warmup_iters * global_batch_size,
                   decay_steps=decay_iters * global_batch_size, decay_style=optim.decay_style,
                   weight_decay=optim.weight_decay)


def lr_at(s: LRSchedule, num_steps: int) -> float:
    """The learning rate after ``num_steps`` samples (Megatron's ``get_lr``)."""
    if s.warmup_steps > 0 and num_steps <= s.warmup_steps:
        return s.init_lr + (s.max_lr - s.init_lr) * float(num_steps) / float(s.warmup_steps)
    if s.decay_style == "constant":
        return s.max_lr
    if num_steps > s.decay_steps:
        return s.min_lr
    if s.decay_style == "inverse-square-root":
        warmup = max(s.warmup_steps, 1)
        lr = s.max_lr * warmup**0.5 / max(num_steps, 1) ** 0.5
        return max(s.min_lr, lr)
    decay_ratio = float(num_steps - s.warmup_steps) / float(s.decay_steps - s.warmup_steps)
    assert 0.0 <= decay_ratio <= 1.0, decay_ratio
    if s.decay_style == "linear":
        coeff = 1.0 - decay_ratio
    elif s.decay_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
    else:
        raise ValueError(f"unknown decay style {s.decay_style!r}")
    return s.min_lr + coeff * (s.max_lr - s.min_lr)


class OptimizerParamScheduler:
    """Sets ``lr`` (and ``weight_decay``, honouring per-group ``wd_mult``) on every param group."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: LRSchedule) -> None:
        self.optimizer = optimizer
        self.schedule = schedule
        self.num_steps = 0
        self.step(0)

    def step(self, increment: int) -> None:
        """Advance by ``increment`` samples and apply the new values to the optimizer."""
        self.num_steps += increment
        lr = lr_at(self.schedule, self.num_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.schedule.weight_decay * group.get("wd_mult", 1.0)

    def get_lr(self) -> float:
        return lr_at(self.schedule, self.num_steps)

    def state_dict(self) -> dict:
        """Megatron's keys (plain types only)."""
        s = self.schedule
        return {"max_lr": s.max_lr, "lr_warmup_steps": s.warmup_steps, "num_steps": self.num_steps,
                "lr_decay_style": s.decay_style, "lr_decay_steps": s.decay_steps, "min_lr": s.min_lr,
                "start_wd": s.weight_decay, "end_wd": s.weight_decay, "wd_incr_style": "constant",
                "wd_incr_steps": s.decay_steps}

    def load_state_dict(self, state: dict) -> None:
        """Restore the position (``num_steps``); the configured schedule wins over a differing saved one
        (Megatron's ``--override-opt_param-scheduler``), with a warning naming what changed."""
        s = self.schedule
        mine = {"max_lr": s.max_lr, "min_lr": s.min_lr, "lr_warmup_steps": s.warmup_steps,
                "lr_decay_steps": s.decay_steps, "lr_decay_style": s.decay_style}
        changed = {k: (state.get(k), v) for k, v in mine.items() if k in state and state[k] != v}
        if changed:
            log.warning("LR schedule differs from the checkpoint's (saved, configured): %s; using the "
                        "configured one from the restored position", changed)
        self.num_steps = 0
        self.step(int(state["num_steps"]))
