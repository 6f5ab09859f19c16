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


@torch.no_grad()
def grad_norm(model: ParallelModel) -> torch.Tensor:
    """The L2 norm (fp32 scalar on the model's device) of the whole model's gradient, on every rank."""
    ps = model.pstate
    sq = torch.zeros((), dtype=torch.float32, device=ps.device)
    if model.grads.shard:
        name_of = {id(p): n for n, p in model.named_parameters()}
        for bucket in model.grads.buckets:
            for p, start, end in model.grads.shard_segments(bucket):
                if _counted_here(model, name_of[id(p)]):
                    sq += bucket.buffer[start:end].float().pow(2).sum()
        comm.all_reduce(sq, ps.dp_group)
    else:
        grads = [p.grad for name, p in model.named_parameters()
                 if p.grad is not None and _counted_here(model, name)]
        for g in grads:
            sq += g.float().pow(2).sum()
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
def clip_grad_norm(model: ParallelModel, max_norm: float) -> float:
    """Scale all gradients so that the global norm is at most ``max_norm`` (Megatron: coefficient
    max_norm / (norm + 1e-6), applied only when below 1); returns the norm before clipping."""
    norm = grad_norm(model)
    coeff = max_norm / (norm.item() + 1e-6)
    if max_norm > 0 and coeff < 1.0 and model.grads.shard:
        torch._foreach_mul_(_shards(model), coeff)
    elif max_norm > 0 and coeff < 1.0:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(coeff)
    return norm.item()
