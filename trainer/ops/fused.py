"""Python face of Slipway's compiled ops (``torch.ops.slipway.*``, built from ``csrc/``).

This module registers, for each C++ op, a fake (meta) kernel so ``torch.compile`` and
``torch.library.opcheck`` can trace it. The csrc schemas name this module (``set_python_module``), so
torch imports it whenever it needs a fake kernel. Autograd is registered in C++ at the Autograd key
(``csrc/autograd.cpp``: each formula calls the matching ``*_backward`` op; C++ saves ~25 us of Python per
call over ``torch.library.register_autograd``). Import this module only after ``_ext.load()`` succeeded.

The functions at the bottom have the same signatures as their eager references in
``trainer/ops/reference.py``; ``trainer.ops.resolve`` hands them to the model (the Llama-style ops
``rms_norm``, ``swiglu`` and ``rotary`` included: csrc/ops_llama.cpp).

Dropout (``bias_dropout_add``): the mask is *regenerated*, not stored. Forward draws one int64 seed with
torch's generator for the tensor's device (``torch.randint``), so the model-parallel RNG tracker, which
forks torch's CPU/CUDA RNG state, controls it exactly as it controls ``F.dropout``; the kernels hash
(seed, element index) into the keep decision (``csrc/slipway_rng.h``), and backward re-hashes instead of
keeping a byte per activation alive until backward. The masks differ from ``F.dropout``'s for the same
torch seed (a different generator), but are equally distributed and reproducible for the same torch seed.
"""

from __future__ import annotations

import torch

from trainer import extension as _ext

if not _ext.load():  # pragma: no cover - resolve() never imports this module without the extension
    raise ImportError("trainer.ops.fused needs the compiled extension trainer._C; run `make install`")

_ops = torch.ops.slipway


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Statistics / compute dtype of the kernels: fp64 for fp64 inputs (gradcheck), else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- fake (meta) kernels: output metadata only; every csrc op returns contiguous tensors --------------

@torch.library.register_fake("slipway::bias_gelu")
def _bias_gelu_fake(x, bias):
    return x.new_empty(x.shape)


@torch.library.register_fake("slipway::bias_gelu_backward")
def _bias_gelu_backward_fake(grad, x, bias):
    return x.new_empty(x.shape)


@torch.library.register_fake("slipway::bias_dropout_add")
def _bias_dropout_add_fake(x, bias, residual, p, seed):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))  # bias never promotes


@torch.library.register_fake("slipway::dropout_backward")
def _dropout_backward_fake(grad, p, seed):
    return grad.new_empty(grad.shape)


@torch.library.register_fake("slipway::scaled_causal_softmax")
def _softmax_fake(scores, scale):
    return scores.new_empty(scores.shape)


@torch.library.register_fake("slipway::scaled_causal_softmax_backward")
def _softmax_backward_fake(grad, probs, scale):
    return probs.new_empty(probs.shape)


@torch.library.register_fake("slipway::layer_norm")
def _layer_norm_fake(x, weight, bias, eps):
    stats = x.new_empty(x.shape[:-1], dtype=_acc(x.dtype))
    return x.new_empty(x.shape), stats, torch.empty_like(stats)


@torch.library.register_fake("slipway::layer_norm_backward")
def _layer_norm_backward_fake(grad, x, weight, mean, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


@torch.library.register_fake("slipway::ce_local_stats")
def _ce_stats_fake(logits, target, vocab_start):
    acc = _acc(logits.dtype)
    return tuple(logits.new_empty(target.shape, dtype=acc) for _ in range(3))


@torch.library.register_fake("slipway::ce_local_grad")
def _ce_grad_fake(logits, target, vocab_start, lse, grad_loss):
    return logits.new_empty(logits.shape)


@torch.library.register_fake("slipway::ce_local_grad_")
def _ce_grad_inplace_fake(logits, target, vocab_start, lse, grad_loss):
    return None


@torch.library.register_fake("slipway::adamw_step_")
def _adamw_fake(params, grads, exp_avgs, exp_avg_sqs, model_params, lr, beta1, beta2, eps, weight_decay,
                step, grad_scale):
    return None


@torch.library.register_fake("slipway::rms_norm")
def _rms_norm_fake(x, weight, eps):
    out = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    return out, x.new_empty(x.shape[:-1], dtype=_acc(x.dtype))


@torch.library.register_fake("slipway::rms_norm_backward")
def _rms_norm_backward_fake(grad, x, weight, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


@torch.library.register_fake("slipway::swiglu")
def _swiglu_fake(x):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.register_fake("slipway::swiglu_backward")
def _swiglu_backward_fake(grad, x):
    return x.new_empty(x.shape)


@torch.library.register_fake("slipway::rotary")
def _rotary_fake(x, cos, sin):
    return x.new_empty(x.shape)


@torch.library.register_fake("slipway::rotary_backward")
def _rotary_backward_fake(grad, cos, sin):
    return grad.new_empty(grad.shape)


# ---- the functions the model calls (signatures of trainer/ops/reference.py) ------------------------------

def dropout_seed(device: torch.device) -> torch.Tensor:
    """One int64 seed from torch's default generator of ``device`` (the one the RNG tracker forks).

    Drawn on the device itself so CUDA kernels read it from memory: no host synchronisation.
    """
    return torch.randint(0, 2**62, (1,), device=device, dtype=torch.int64)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """GeLU(x + bias), tanh approximation, in x's dtype (bias may be fp32 under autocast)."""
    return _ops.bias_gelu(x, bias)


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float,
                     training: bool) -> torch.Tensor:
    """residual + dropout(x + bias), fp32 math, in the promoted dtype of x and the residual (an fp32
    bias under autocast does not promote the residual stream to fp32)."""
    p = float(p) if training else 0.0
    seed = dropout_seed(x.device) if p > 0.0 else x.new_zeros(1, dtype=torch.int64)
    return _ops.bias_dropout_add(x, bias, residual, p, seed)


def scaled_causal_softmax(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale·scores) over the last dim with future keys masked; fp32 math, scores' dtype out."""
    return _ops.scaled_causal_softmax(scores, float(scale))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim, fp32 statistics, x's dtype out."""
    return _ops.layer_norm(x, weight, bias, float(eps))[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, fp32 statistics; the reference's dtype (x's, or fp32 for a bf16/fp16 x
    with an fp32 weight) and rounding order (normalised row rounded to x's dtype, then times the weight)."""
    return _ops.rms_norm(x, weight, float(eps))[0]


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) · up for ``x = [gate | up]`` on the last dim, fp32 math, x's dtype out."""
    return _ops.swiglu(x)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary apply, rotate-half layout, over the first ``cos.shape[-1]`` dims of x [..., s, d]; fp32 math,
    x's dtype out. cos/sin [s, d_rot] get no gradient (position tables)."""
    return _ops.rotary(x, cos, sin)
