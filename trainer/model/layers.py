"""The GPT's building blocks that hold weights or position tables: linear, lookup table, the two norms,
and the rotary position table. Single-device; tensor parallelism swaps them from outside.

Linear layers return ``(x·Wᵀ, bias)`` without adding the bias (Megatron's skip_bias_add), so that the
bias is fused into bias-GeLU / bias-dropout-add and a row-parallel bias is added once after the reduce.
Without biases (``model.add_bias_linear=false``, Megatron's --disable-bias-linear) the bias is None.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer.ops import KernelSet

Tensor = torch.Tensor


class Linear(nn.Module):
    """``y = x·Wᵀ`` returned together with the un-added bias (skip_bias_add; None without one)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        return F.linear(x, self.weight), self.bias


class EmbeddingTable(nn.Module):
    """A lookup table ``weight[ids]``: nn.Embedding minus its own init (slow on the meta device). Also
    holds the untied LM head's ``output_layer`` weight (same shape, same vocab-row sharding)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def forward(self, ids: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """Rows of the table, in ``dtype`` (the table is cast first: one cast of [V, h] instead of an
        fp32 [tokens, h] gather and its cast) or in the table's own dtype."""
        return F.embedding(ids, self.weight if dtype is None else self.weight.to(dtype))


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast computes in on ``device`` when it is on, else None."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


class LayerNorm(nn.Module):
    """LayerNorm through the kernel set (fp32 statistics)."""

    def __init__(self, hidden_size: int, eps: float, kernels: KernelSet) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.bias = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: Tensor) -> Tensor:
        return self.kernels.layer_norm(x, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """RMSNorm through the kernel set: weight only (Megatron's RMSNorm and HF LlamaRMSNorm store just it)."""

    def __init__(self, hidden_size: int, eps: float, kernels: KernelSet) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: Tensor) -> Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)


def make_norm(normalization: str, hidden_size: int, eps: float, kernels: KernelSet) -> nn.Module:
    """The configured norm (``model.normalization``: layernorm | rmsnorm)."""
    return (RMSNorm if normalization == "rmsnorm" else LayerNorm)(hidden_size, eps, kernels)


class RotaryTable(nn.Module):
    """cos/sin of the rotary angles for positions 0…s−1, [s, d_rot] fp32, in the rotate-half layout
    (each frequency repeated for both halves): Megatron-core's RotaryEmbedding (rotary_interleaved=False)
    and HF Llama's default rope, θ_j = base^(−2j/d_rot). No parameters (nothing to shard or checkpoint);
    the table is recomputed when the length or device changes and cached otherwise."""

    def __init__(self, rotary_dim: int, base: float) -> None:
        super().__init__()
        self.rotary_dim, self.base = rotary_dim, base
        self._cache: tuple[int, torch.device, Tensor, Tensor] | None = None

    def forward(self, s: int, device: torch.device) -> tuple[Tensor, Tensor]:
        if self._cache is None or self._cache[:2] != (s, device):
            # int64 arange then float, as HF computes inv_freq, so the fp32 angles agree bit for bit.
            exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device=device).float()
            inv_freq = 1.0 / (self.base ** (exponents / self.rotary_dim))
            angles = torch.outer(torch.arange(s, device=device, dtype=torch.float32), inv_freq)
            emb = torch.cat((angles, angles), dim=-1)                  # [s, d_rot]
            self._cache = (s, device, emb.cos(), emb.sin())
        return self._cache[2], self._cache[3]
