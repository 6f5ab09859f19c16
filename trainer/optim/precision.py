"""Mixed precision: the two bf16/fp16 recipes (``train.precision_recipe``) and Megatron's dynamic loss
scaler.

``autocast``: parameters, gradients and optimizer state stay fp32 (the master weights *are* the
parameters) and the forward runs under ``torch.autocast`` in the low-precision dtype. Every activation
is in that dtype, the residual stream included: the embedding casts its tables (trainer.model.layers),
the fused bias-dropout-add keeps x's and the residual's dtype (an fp32 bias does not promote it), the QKV
bias is added in the activations' dtype, and LayerNorm returns its (bf16) input's dtype with fp32
statistics. Only per-token statistics, the loss and the fp32 parameter gradients are fp32
(tests/model/test_dtype_flow.py holds that list). Gradients accumulate in fp32 over micro-batches for
free (autocast casts weights per use, their grads land in the fp32 ``.grad``) and checkpoints hold fp32
weights directly. Costs: one cast of each weight per micro-batch and fp32 parameter memory.

``master_weights`` (Megatron's ``--bf16``/``--fp16``): 16-bit parameters and activations, no autocast,
fp32 master weights and fp32 gradient accumulation in the optimizer. It is the distributed optimizer's
layout (trainer.parallel.dist_optimizer: fp32 gradient buckets fed by a hook per micro-batch, the fp32
masters and moments sharded over dp — at dp 1 the whole model), so it checkpoints as that does: 16-bit
weights in ``model`` and the fp32 masters in ``distrib_optim.pt``. Saves the per-use weight casts and
2 bytes per parameter of weights; the GPU measurement in bench/gpu_check.sh decides which is faster.

fp16 additionally needs loss scaling: ``DynamicLossScaler`` is Megatron's ``DynamicGradScaler``
(initial 2^32, growth window 1000, hysteresis 2, backoff 0.5, growth 2, minimum 1). A step whose
gradients overflow is skipped (no optimizer update) and counted; the scheduler still advances, as in
Megatron.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from trainer.config.train import precision_recipe
from trainer.ops.dtypes import DTYPES


def param_dtype(precision: str, master_weights: bool) -> torch.dtype:
    """The parameters' dtype: 16-bit for bf16/fp16 under the master_weights recipe (the distributed
    optimizer's layout), fp32 otherwise (autocast casts per use)."""
    return DTYPES[precision] if master_weights else torch.float32


def uses_master_weights(precision: str, recipe: str, distributed: bool) -> bool:
    """Whether the run keeps 16-bit parameters with fp32 masters (``train.precision_recipe`` resolved)."""
    return precision_recipe(precision, recipe, distributed) == "master_weights"


def autocast_dtype(precision: str, recipe: str, distributed: bool) -> torch.dtype | None:
    """The dtype the forward runs under ``torch.autocast`` in: the autocast recipe's, else None."""
    return DTYPES[precision] if precision_recipe(precision, recipe, distributed) == "autocast" else None


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
