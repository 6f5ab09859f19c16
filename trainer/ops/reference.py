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
    """residual + dropout(x + bias)."""
    y = x if bias is None else x + bias
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


def attention_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
