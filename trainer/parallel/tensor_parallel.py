"""Tensor-parallel layers (Megatron-LM, Shoeybi et al. 2019) and the vocab-parallel cross-entropy.

Each layer is a drop-in for the single-device module it replaces (same forward signature, same parameter
names) and knows how its parameters shard the full tensors (``full_shape`` / ``shard_param``, used by the
layout-independent init and by checkpoint code via ``partition_dim``). With ``sequence_parallel`` the
activations entering a column-parallel layer are sequence-sharded ([s/tp, b, h]) and are all-gathered;
a row-parallel layer reduce-scatters its output back onto the sequence instead of all-reducing it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.parallel import comm
from trainer.parallel.sharding import COLUMN, DIM, GLU, REPLICATED, ROW, VOCAB, split_tp
from trainer.parallel.state import Group

Tensor = torch.Tensor


class _Sharded(nn.Module):
    """Common bookkeeping: which dim of which parameter is split over the TP group."""

    partition_dims: dict[str, int | None] = {}

    def __init__(self, group: Group) -> None:
        super().__init__()
        self.group = group

    def partition_dim(self, name: str) -> int | None:
        """The dim ``name`` is split along across TP ranks, or None when replicated."""
        return self.partition_dims.get(name)

    def full_shape(self, name: str) -> torch.Size:
        shape, dim = list(getattr(self, name).shape), self.partition_dim(name)
        if dim is not None:
            shape[dim] *= self.group.size
        return torch.Size(shape)

    def shard_param(self, name: str, full: Tensor) -> Tensor:
        dim = self.partition_dim(name)
        return full if dim is None else comm.split_dim(full, self.group, dim)


def _check_divisible(what: str, n: int, tp: int) -> None:
    if n % tp:
        raise ValueError(f"{what}={n} does not divide by tp_size={tp}; choose a tp_size that divides it")


class ColumnParallelLinear(_Sharded):
    """Y_i = X·A_iᵀ: the output features (rows of A, and the bias) are split; returns (Y_i, b_i).

    ``glu``: A is a SwiGLU [gate; up] pair and rank i holds [gate_i; up_i] (sharding.GLU), so its local
    SiLU(gate_i)·up_i is its own slice of the MLP's inner features."""

    partition_dims = {"weight": DIM[COLUMN], "bias": DIM[COLUMN]}

    def __init__(self, in_features: int, out_features: int, group: Group, sequence_parallel: bool,
                 bias: bool = True, glu: bool = False) -> None:
        super().__init__(group)
        _check_divisible("output features", out_features // 2 if glu else out_features, group.size)
        self.weight = nn.Parameter(torch.empty(out_features // group.size, in_features))
        self.bias = nn.Parameter(torch.empty(out_features // group.size)) if bias else None
        self.sequence_parallel, self.glu = sequence_parallel, glu

    def shard_param(self, name: str, full: Tensor) -> Tensor:
        if not self.glu:
            return super().shard_param(name, full)
        return split_tp(full, GLU, self.group.size)[self.group.index]

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:   # x: [s(/tp), b, in]
        if self.sequence_parallel:
            x = comm.gather_from_sequence(x, self.group)     # [s, b, in]
        else:
            x = comm.copy_to_region(x, self.group)
        return F.linear(x, self.weight), self.bias           # [s, b, out/tp]


class RowParallelLinear(_Sharded):
    """Y = Σ_i X_i·A_iᵀ: the input features (columns of A) are split; bias replicated, added by caller."""

    partition_dims = {"weight": DIM[ROW], "bias": DIM[REPLICATED]}

    def __init__(self, in_features: int, out_features: int, group: Group, sequence_parallel: bool,
                 bias: bool = True) -> None:
        super().__init__(group)
        _check_divisible("input features", in_features, group.size)
        self.weight = nn.Parameter(torch.empty(out_features, in_features // group.size))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.sequence_parallel = sequence_parallel

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:   # x: [s, b, in/tp]
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            return comm.reduce_scatter_to_sequence(y, self.group), self.bias  # [s/tp, b, out]
        return comm.reduce_from_region(y, self.group), self.bias              # [s, b, out]


class VocabParallelEmbedding(_Sharded):
    """Embedding whose rows (the padded vocabulary) are split into contiguous ranges across TP ranks.

    Each rank looks up the tokens in its range (zeros elsewhere); the all-reduce assembles the result.
    Also used for ``word_embeddings_for_head`` so that both copies of the tied weight shard alike.
    """

    partition_dims = {"weight": DIM[VOCAB]}

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Group) -> None:
        super().__init__(group)
        _check_divisible("padded vocab size", num_embeddings, group.size)
        per_rank = num_embeddings // group.size
        self.vocab_start = group.index * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim))

    def forward(self, tokens: Tensor, dtype: torch.dtype | None = None) -> Tensor:  # [b, s] → [b, s, h]
        weight = self.weight if dtype is None else self.weight.to(dtype)  # as EmbeddingTable
        if self.group.size == 1:
            return F.embedding(tokens, weight)
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return comm.reduce_from_region(out, self.group)


class ScatterToSequence(nn.Module):
    """Sequence parallelism's entry: keep this rank's chunk of the [s, b, h] embeddings."""

    def __init__(self, group: Group) -> None:
        super().__init__()
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        return comm.scatter_to_sequence(x, self.group)


class VocabParallelLMHead(nn.Module):
    """Logits against this rank's vocabulary shard; loss by :func:`vocab_parallel_cross_entropy`."""

    def __init__(self, vocab_size: int, group: Group, sequence_parallel: bool) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.group = group
        self.sequence_parallel = sequence_parallel

    def forward(self, x: Tensor, weight: Tensor, labels: Tensor | None = None) -> Tensor:
        """x [s(/tp), b, h] → logits [b, s, V_pad/tp]; with labels [b, s] → per-token loss [b, s]."""
        if self.sequence_parallel:
            x = comm.gather_from_sequence(x, self.group)
        else:
            x = comm.copy_to_region(x, self.group)
        logits = F.linear(x, weight).transpose(0, 1)          # [b, s, V_pad/tp]
        if labels is None:
            return logits
        vocab_start = self.group.index * weight.shape[0]
        return vocab_parallel_cross_entropy(logits, labels, self.group, vocab_start, self.vocab_size)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over vocab-sharded logits without gathering them: three all-reduces of [tokens]
    (max, target logit, sum of exp). Columns at global index >= ``vocab_size`` (padding) are excluded."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, group: Group, vocab_start: int,
                vocab_size: int | None) -> Tensor:
        logits_dtype = logits.dtype
        logits = logits.float()
        local_vocab = logits.shape[-1]
        if vocab_size is not None and vocab_start + local_vocab > vocab_size:
            padded = torch.arange(vocab_start, vocab_start + local_vocab, device=logits.device) >= vocab_size
            logits = logits.masked_fill(padded, float("-inf"))
        logits_max = comm.all_reduce(logits.max(dim=-1).values, group, dist.ReduceOp.MAX)
        logits = logits - logits_max.unsqueeze(-1)
        outside = (target < vocab_start) | (target >= vocab_start + local_vocab)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        comm.all_reduce(target_logit, group)
        exp = logits.exp()
        sum_exp = comm.all_reduce(exp.sum(dim=-1), group)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_target)
        ctx.input_dtype = logits_dtype
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        softmax, outside, local_target = ctx.saved_tensors
        # d loss / d logits = softmax − one_hot(target), the one-hot living on the rank that owns it.
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, local_target.unsqueeze(-1), (outside.float() - 1.0).unsqueeze(-1))
        return grad_logits.mul_(grad.unsqueeze(-1)).to(ctx.input_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, group: Group, vocab_start: int,
                                 vocab_size: int | None = None) -> Tensor:
    """Per-token CE (fp32) of logits [..., V_local] (this rank's columns from ``vocab_start``) and
    target [...] of global ids; padded columns (global id >= vocab_size) are left out of the softmax."""
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_start, vocab_size)
