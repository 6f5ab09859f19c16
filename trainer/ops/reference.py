"""Eager reference implementations: the single source of truth every fused kernel is tested against.

Each function is the plain PyTorch composition that a fused op replaces.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """GeLU(x + bias) with the tanh approximation (Megatron's fused bias-GeLU, HF ``gelu_new``)."""
    return F.gelu(x + bias, approximate="tanh")


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float,
                     training: bool) -> torch.Tensor:
    """residual + dropout(x + bias), in the promoted dtype of x and the residual: the bias is a parameter
    (fp32 under autocast) cast to that dtype, as autocast casts a linear layer's bias, so it does not
    promote the residual stream. (The fused kernels add it in fp32 and round once.)"""
    y = x if bias is None else x + bias.to(torch.promote_types(x.dtype, residual.dtype))
    return residual + F.dropout(y, p=p, training=training)


def scaled_causal_softmax(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale·scores) with the upper triangle (future positions) masked, over the last dim.

    scores: [..., sq, sk]; position i may attend to keys j <= i + (sk - sq).
    """
    sq, sk = scores.shape[-2], scores.shape[-1]
    mask = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu(sk - sq + 1)
    z = (scores.float() * scale).masked_fill(mask, float("-inf"))
    return torch.softmax(z, dim=-1).to(scores.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim with fp32 statistics for low-precision inputs."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (Zhang & Sennrich 2019; Megatron's ``--normalization RMSNorm``): fp32
    statistics, normalised in fp32 and cast back before the weight multiplies, in HF Llama's order."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) · up for ``x = [gate | up]`` along the last dim (Megatron's ``--swiglu``: the first MLP
    matmul produces both halves; Shazeer 2020)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021) in the rotate-half layout (Megatron-core's default and
    HF Llama's): ``x`` [..., s, d]; ``cos``/``sin`` [s, d_rot] (each angle repeated for both halves),
    d_rot ≤ d (``rotary_percent``); dims past d_rot pass through. Computed in fp32, cast back."""
    d_rot = cos.shape[-1]
    rot, rest = x[..., :d_rot].float(), x[..., d_rot:]
    first, second = rot.chunk(2, dim=-1)
    out = rot * cos.float() + torch.cat((-second, first), dim=-1) * sin.float()
    return torch.cat((out.to(x.dtype), rest), dim=-1)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """Per-token cross-entropy in fp32 (fp64 stays fp64), unreduced: what the fused loss replaces.
    ``vocab_size``: the true vocabulary; the padded columns past it are left out."""
    if vocab_size is not None and vocab_size < logits.shape[-1]:
        logits = logits[..., :vocab_size]
    flat = logits.reshape(-1, logits.shape[-1])
    flat = flat.to(torch.promote_types(flat.dtype, torch.float32))  # fp32 math; fp64 stays fp64
    return F.cross_entropy(flat, target.reshape(-1), reduction="none").view(target.shape)


def adamw_step(t, hp, step: int) -> None:
    """``torch.optim.AdamW``'s single-tensor update, op for op, on fp32 masters (``trainer.ops.adamw``).

    ``t``: AdamWTensors, ``hp``: AdamWHyper. Low-precision model copies, when given, receive the result.
    """
    bc1 = 1 - hp.beta1 ** step
    bc2_sqrt = math.sqrt(1 - hp.beta2 ** step)
    with torch.no_grad():
        for i, p in enumerate(t.params):
            g = t.grads[i].float() * hp.grad_scale if hp.grad_scale != 1.0 else t.grads[i].float()
            p.mul_(1 - hp.lr * hp.weight_decay)
            t.exp_avgs[i].lerp_(g, 1 - hp.beta1)
            t.exp_avg_sqs[i].mul_(hp.beta2).addcmul_(g, g, value=1 - hp.beta2)
            denom = (t.exp_avg_sqs[i].sqrt() / bc2_sqrt).add_(hp.eps)
            p.addcdiv_(t.exp_avgs[i], denom, value=-(hp.lr / bc1))
            if t.model_params:
                t.model_params[i].copy_(p)
