"""Mixed precision: autocast contexts and Megatron's dynamic loss scaler.

Design choice (bf16 and fp16): parameters, gradients and optimizer state stay fp32 (the master weights
*are* the parameters), and the forward/backward run under ``torch.autocast`` in the low-precision dtype.
Why autocast rather than Megatron's bf16 parameters + separate fp32 ``main_grad`` buffers: gradients
accumulate in fp32 over micro-batches for free (autocast casts weights per use, their grads land in the
fp32 ``.grad``), the optimizer needs no master-weight copy, the parallel layer's gradient all-reduce and
norm computation work unchanged, and checkpoints hold fp32 weights directly. The cost is one cast of each
weight per micro-batch (small next to the matmuls for models of CodeParrot's size) and fp32 parameter
memory (which the fp32 master copy would need anyway).

fp16 additionally needs loss scaling: ``DynamicLossScaler`` is Megatron's ``DynamicGradScaler``
(initial 2^32, growth window 1000, hysteresis 2, backoff 0.5, growth 2, minimum 1). A step whose
gradients overflow is skipped (no optimizer update) and counted; the scheduler still advances, as in
Megatron.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from trainer.ops.dtypes import DTYPES


def compute_dtype(precision: str) -> torch.dtype:
    """The activation dtype for a ``train.precision`` value."""
    return DTYPES[precision]


def param_dtype(precision: str, distributed: bool) -> torch.dtype:
    """The parameters' dtype: fp32 (autocast casts per use), except under the distributed optimizer,
    which keeps 16-bit parameters for bf16/fp16 (Megatron's layout; trainer.parallel.dist_optimizer)."""
    return DTYPES[precision] if distributed else torch.float32


def autocast(precision: str, device_type: str) -> contextlib.AbstractContextManager:
    """The forward-pass context: a no-op for fp32, ``torch.autocast`` for bf16/fp16."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=DTYPES[precision])


@dataclass
class ScalerSettings:
    """Megatron's fp16 loss-scaling arguments."""

    initial_scale: float = 2.0**32
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5


class ConstantLossScaler:
    """fp32/bf16: scale 1, nothing to update (Megatron logs ``loss scale: 1.0`` there too)."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        pass


class DynamicLossScaler:
    """Megatron's ``DynamicGradScaler``: back off after ``hysteresis`` overflows, grow after ``window``
    consecutive clean steps. The hysteresis budget is restored only when the scale grows (as Megatron)."""

    dynamic = True

    def __init__(self, settings: ScalerSettings) -> None:
        self.settings = settings
        self.scale = float(settings.initial_scale)
        self.growth_tracker = 0
        self.hysteresis_tracker = settings.hysteresis

    def update(self, found_inf: bool) -> None:
        s = self.settings
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * s.backoff_factor, s.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == s.window:
                self.growth_tracker = 0
                self.hysteresis_tracker = s.hysteresis
                self.scale = self.scale * s.growth_factor

    def state_dict(self) -> dict:
        """Megatron's keys, as plain Python numbers."""
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])


LossScaler = ConstantLossScaler | DynamicLossScaler


def make_scaler(precision: str, settings: ScalerSettings) -> LossScaler:
    """Dynamic loss scaling for fp16, constant scale 1 otherwise."""
    return DynamicLossScaler(settings) if precision == "fp16" else ConstantLossScaler()


def unscale_grads_(params: list[torch.nn.Parameter], scale: float) -> None:
    """Divide every gradient by ``scale`` in place (one multi-tensor op); non-finite values stay so,
    so the global gradient norm computed afterwards detects overflow."""
    if scale == 1.0:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, 1.0 / scale)
