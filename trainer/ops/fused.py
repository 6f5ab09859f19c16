"""Python face of Slipway's compiled ops (``torch.ops.slipway.*``, built from ``csrc/``).

This module registers, for each C++ op, a fake (meta) kernel so ``torch.compile`` and
``torch.library.opcheck`` can trace it, and autograd formulas (``torch.library.register_autograd``) that
call the matching backward op. The csrc schemas name this module (``set_python_module``), so torch
imports it whenever it needs a fake kernel. Import it only after ``trainer.ops._ext.load()`` succeeded.

The functions at the bottom have the same signatures as their eager references in
``trainer/ops/reference.py``; ``trainer.ops.resolve`` hands them to the model.

Dropout (``bias_dropout_add``): the mask is *regenerated*, not stored. Forward draws one int64 seed with
torch's generator for the tensor's device (``torch.randint``), so the model-parallel RNG tracker, which
forks torch's CPU/CUDA RNG state, controls it exactly as it controls ``F.dropout``; the kernels hash
(seed, element index) into the keep decision (``csrc/slipway_rng.h``), and backward re-hashes instead of
keeping a byte per activation alive until backward. The masks differ from ``F.dropout``'s for the same
torch seed (a different generator), but are equally distributed and reproducible for the same torch seed.
"""

from __future__ import annotations

import torch

from trainer.ops import _ext

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
    dtype = torch.promote_types(x.dtype, residual.dtype)
    if bias is not None:
        dtype = torch.promote_types(dtype, bias.dtype)
    return x.new_empty(x.shape, dtype=dtype)


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


# ---- autograd ------------------------------------------------------------------------------------------

def _bias_grad(grad_x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Σ over all rows of the gradient of (x + bias), accumulated in fp32, in bias's dtype."""
    rows = grad_x.reshape(-1, bias.numel())
    return rows.sum(0, dtype=_acc(rows.dtype)).to(bias.dtype)


def _bias_gelu_setup(ctx, inputs, output):
    x, bias = inputs
    ctx.save_for_backward(x, bias)


def _bias_gelu_backward(ctx, grad):
    x, bias = ctx.saved_tensors
    gx = _ops.bias_gelu_backward(grad.to(x.dtype), x, bias)
    gb = _bias_grad(gx, bias) if ctx.needs_input_grad[1] else None
    return gx, gb


torch.library.register_autograd("slipway::bias_gelu", _bias_gelu_backward, setup_context=_bias_gelu_setup)


def _bda_setup(ctx, inputs, output):
    x, bias, residual, p, seed = inputs
    ctx.save_for_backward(seed, bias if bias is not None else None)
    ctx.p = p
    ctx.x_dtype = x.dtype
    ctx.residual_dtype = residual.dtype


def _bda_backward(ctx, grad):
    seed, bias = ctx.saved_tensors
    g_in = _ops.dropout_backward(grad, ctx.p, seed)  # gradient of (x + bias), in the output dtype
    gb = _bias_grad(g_in, bias) if bias is not None and ctx.needs_input_grad[1] else None
    gx = g_in.to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
    gres = grad.to(ctx.residual_dtype) if ctx.needs_input_grad[2] else None
    return gx, gb, gres, None, None


torch.library.register_autograd("slipway::bias_dropout_add", _bda_backward, setup_context=_bda_setup)


def _softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.scale = inputs[1]


def _softmax_backward(ctx, grad):
    (probs,) = ctx.saved_tensors
    return _ops.scaled_causal_softmax_backward(grad.to(probs.dtype), probs, ctx.scale), None


torch.library.register_autograd("slipway::scaled_causal_softmax", _softmax_backward,
                                setup_context=_softmax_setup)


def _layer_norm_setup(ctx, inputs, output):
    x, weight, _bias, _eps = inputs
    _y, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, mean, rstd)


def _layer_norm_backward(ctx, grad_y, _grad_mean, _grad_rstd):
    x, weight, mean, rstd = ctx.saved_tensors
    gx, gw, gb = _ops.layer_norm_backward(grad_y.to(x.dtype), x, weight, mean, rstd)
    return gx, gw, gb, None


torch.library.register_autograd("slipway::layer_norm", _layer_norm_backward, setup_context=_layer_norm_setup)


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
    """residual + dropout(x + bias), in the promoted dtype of the three (as eager PyTorch)."""
    p = float(p) if training else 0.0
    seed = dropout_seed(x.device) if p > 0.0 else x.new_zeros(1, dtype=torch.int64)
    return _ops.bias_dropout_add(x, bias, residual, p, seed)


def scaled_causal_softmax(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale·scores) over the last dim with future keys masked; fp32 math, scores' dtype out."""
    return _ops.scaled_causal_softmax(scores, float(scale))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim, fp32 statistics, x's dtype out."""
    return _ops.layer_norm(x, weight, bias, float(eps))[0]
