"""Global gradient norm over all parameters of all ranks, each counted once, and clipping by it.

A parameter's gradient is counted on this rank unless another rank holds the same values: parameters
replicated across TP (LayerNorms, row-parallel biases, position embeddings) count on tp_rank 0 only; the
last stage's copy of the tied word embeddings (``word_embeddings_for_head``) is counted on the first
stage only; DP replicas hold identical (averaged) gradients, so the sum runs over the TP and PP groups of
one DP replica. Call after gradient synchronisation (train_step does it).

With the distributed optimizer (``model.grads.shard``) each DP rank holds the reduced gradient of its
shard only: the sum of squares runs over the shard segments (each element on exactly one DP rank) and is
all-reduced over the DP group as well; clipping and unscaling scale the shards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from trainer.optim.precision import unscale_grads_
from trainer.parallel import comm

if TYPE_CHECKING:
    from trainer.parallel.engine import ParallelModel


def _counted_here(model: ParallelModel, name: str) -> bool:
    ps = model.pstate
    if name.startswith("word_embeddings_for_head.") and ps.pp_size > 1:
        return False
    return model.partition_dims[name] is not None or ps.tp_rank == 0


def _counted(model: ParallelModel) -> list[torch.Tensor]:
    """The gradient pieces this rank counts in the global norm (see the module docstring)."""
    grads = model.grads
    if grads.shard:
        name_of = {id(p): n for n, p in model.named_parameters()}
        return [b.buffer[start:end] for b in grads.buckets for p, start, end in grads.shard_segments(b)
                if _counted_here(model, name_of[id(p)])]
    return [grads.main_grad(p) for name, p in model.named_parameters() if _counted_here(model, name)]


@torch.no_grad()
def grad_norm(model: ParallelModel) -> torch.Tensor:
    """The L2 norm (fp32 scalar on the model's device) of the whole model's gradient, on every rank.
    Multi-tensor (``torch._foreach_norm``) and never read on the host: no synchronisation."""
    ps = model.pstate
    pieces = _counted(model)
    if pieces:
        sq = torch.stack(torch._foreach_norm(pieces, 2, dtype=torch.float32)).pow(2).sum()
    else:
        sq = torch.zeros((), dtype=torch.float32, device=ps.device)
    if model.grads.shard:
        comm.all_reduce(sq, ps.dp_group)
    comm.all_reduce(sq, ps.tp_group)
    comm.all_reduce(sq, ps.pp_group)
    return sq.sqrt()


def _shards(model: ParallelModel) -> list[torch.Tensor]:
    grads = model.grads
    return [b.buffer[slice(*grads.shard_range(b))] for b in grads.buckets]


@torch.no_grad()
def unscale_main_grads_(model: ParallelModel, scale: float) -> None:
    """Divide the gradients by the loss scale (sharded: this rank's shards; non-finite values stay so)."""
    if not model.grads.shard:
        unscale_grads_(model.parameters(), scale)
    elif scale != 1.0:
        torch._foreach_mul_(_shards(model), 1.0 / scale)


@torch.no_grad()
def clip_by_global_norm(model: ParallelModel, max_norm: float) -> torch.Tensor:
    """Scale all gradients so that the global norm is at most ``max_norm`` and return the norm before
    clipping, as a device tensor: nothing is read on the host. Megatron's coefficient max_norm /
    (norm + 1e-6), applied only below 1: here min(coefficient, 1) multiplies every gradient buffer in one
    multi-tensor op (multiplying by exactly 1 changes nothing), instead of a host-side comparison."""
    norm = grad_norm(model)
    if max_norm > 0:
        coeff = (max_norm / (norm.double() + 1e-6)).clamp(max=1.0)  # fp64 as Megatron's Python float
        torch._foreach_mul_(_shards(model), coeff)
    return norm


@torch.no_grad()
def clip_grad_norm(model: ParallelModel, max_norm: float) -> float:
    """:func:`clip_by_global_norm`, with the norm read back as a float (one host synchronisation)."""
    return float(clip_by_global_norm(model, max_norm))
