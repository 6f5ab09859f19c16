"""Fused cross-entropy over a (possibly vocab-parallel) shard of the logits.

The logits of a small GPT step are its largest activation ([tokens, V], V = 32768 for CodeParrot). The
eager loss (``F.cross_entropy(logits.float(), ...)``) writes an fp32 copy and a log-softmax of that size
and backward writes another. Here the forward reads the logits once and keeps three fp32 numbers per
token; backward writes the gradient once (optionally into the logits' own memory).

Local-shard primitives, for a tensor-parallel loss (Megatron's ``_VocabParallelCrossEntropy``) where
rank r holds logits[..., vocab_start:vocab_end]::

    mx, se, tl = ce_local_stats(logits, target, vocab_start, vocab_end)   # one pass over the shard
    gmx = all_reduce(mx.clone(), MAX);  se *= exp(mx − gmx)
    all_reduce(se, SUM); all_reduce(tl, SUM)        # tl is 0 on ranks that do not hold the target
    lse = gmx + log(se);  loss = lse − tl
    # backward, with g = dloss (per token):
    ce_local_grad_(logits, target, vocab_start, vocab_end, lse, g)        # logits now hold dlogits

``cross_entropy(..., group=tp_group)`` does exactly this inside one autograd function.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer import extension as _ext


def _check_shard(logits: torch.Tensor, vocab_start: int, vocab_end: int) -> None:
    if vocab_end - vocab_start != logits.shape[-1]:
        raise ValueError(f"vocab shard [{vocab_start}, {vocab_end}) has {vocab_end - vocab_start} entries "
                         f"but logits.shape[-1] = {logits.shape[-1]}; pass this rank's shard bounds")


def ce_local_stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, vocab_end: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token over this shard: (max logit, Σ exp(logit − max), target logit or 0), all fp32.

    logits: [..., vocab_end − vocab_start] (fp32/bf16/fp16; unit stride along vocab, any row stride);
    target: [...] int64 global token ids. Targets outside the shard contribute a target logit of 0.
    """
    _check_shard(logits, vocab_start, vocab_end)
    return torch.ops.slipway.ce_local_stats(logits, target, int(vocab_start))


def ce_local_grad_(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, vocab_end: int,
                   lse: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
    """Overwrite contiguous ``logits`` with d(loss)/d(logits) = (softmax − onehot)·grad_loss; returns it.

    lse: [...] global log-sum-exp per token (fp32); grad_loss: [...] upstream gradient per token.
    """
    _check_shard(logits, vocab_start, vocab_end)
    torch.ops.slipway.ce_local_grad_(logits, target, int(vocab_start), lse, grad_loss)
    return logits


def ce_local_grad(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, vocab_end: int,
                  lse: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
    """Out-of-place :func:`ce_local_grad_`: a new contiguous tensor in logits' dtype."""
    _check_shard(logits, vocab_start, vocab_end)
    return torch.ops.slipway.ce_local_grad(logits, target, int(vocab_start), lse, grad_loss)


def _global_lse(stats, group) -> torch.Tensor:
    """Combine per-shard (max, sumexp) into the global log-sum-exp; the target logit is summed in place."""
    mx, se, tl = stats
    if group is not None and dist.get_world_size(group) > 1:
        gmx = mx.clone()
        dist.all_reduce(gmx, op=dist.ReduceOp.MAX, group=group)
        se = se * torch.exp(mx - gmx)
        dist.all_reduce(se, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(tl, op=dist.ReduceOp.SUM, group=group)
        mx = gmx
    return mx + torch.log(se)


class _FusedCrossEntropy(torch.autograd.Function):
    """Per-token loss from the local-shard ops; the all-reduces sit between them, hence a Python Function.

    ``valid``: the leading local columns that are real vocabulary (the rest is padding: excluded from the
    softmax, zero gradient). The padding is cut inside the Function, so autograd records no slice, whose
    backward would zero-fill a [tokens, V] tensor and copy the gradient into it."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, group, inplace_grad, valid):
        view = logits[..., :valid] if valid < logits.shape[-1] else logits
        stats = torch.ops.slipway.ce_local_stats(view, target, vocab_start)
        lse = _global_lse(stats, group)
        ctx.save_for_backward(logits, target, lse)
        ctx.vocab_start, ctx.valid = vocab_start, valid
        # In place needs the rows at one stride (contiguous logits, or a [..., :valid] slice of them).
        ctx.inplace_grad = inplace_grad and logits.is_contiguous()
        return lse - stats[2]

    @staticmethod
    def backward(ctx, grad_loss):
        logits, target, lse = ctx.saved_tensors
        g = grad_loss.contiguous()
        valid, padded = ctx.valid, ctx.valid < logits.shape[-1]
        if ctx.inplace_grad:
            rows = logits[..., :valid] if padded else logits
            torch.ops.slipway.ce_local_grad_(rows, target, ctx.vocab_start, lse, g)
            grad = logits
        elif padded:
            grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
            grad[..., :valid] = torch.ops.slipway.ce_local_grad(logits[..., :valid], target, ctx.vocab_start,
                                                                lse, g)
        else:
            return torch.ops.slipway.ce_local_grad(logits, target, ctx.vocab_start, lse, g), *(None,) * 5
        if padded:
            grad[..., valid:].zero_()  # padding columns only (a few per row)
        return grad, None, None, None, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_start: int = 0,
                  group: dist.ProcessGroup | None = None, inplace_grad: bool = False,
                  vocab_size: int | None = None) -> torch.Tensor:
    """Per-token cross-entropy (fp32, shaped like target), unreduced: the caller applies its loss mask.

    With ``group`` (the tensor-parallel group) ``logits`` is this rank's vocab shard starting at
    ``vocab_start``. ``inplace_grad=True`` writes the gradient into the logits' memory (Megatron's
    trick, saving one [tokens, V] buffer): only when nothing else saved those logits for backward.
    ``vocab_size``: the true vocabulary; columns of global id >= it are padding, excluded from the loss
    (their gradient is zero) without a slice of the logits (default: every column is real).
    """
    if not _ext.load():
        raise RuntimeError("trainer.ops.cross_entropy needs trainer._C; run `make install` or use "
                           "trainer.ops.reference.cross_entropy")
    local = logits.shape[-1]
    valid = local if vocab_size is None else max(0, min(local, int(vocab_size) - int(vocab_start)))
    return _FusedCrossEntropy.apply(logits, target, int(vocab_start), group, bool(inplace_grad), valid)


def head_loss(logits: torch.Tensor, target: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """The kernel set's loss (the LM head's): :func:`cross_entropy` with the gradient written over the
    logits (Megatron's trick: one [tokens, V] buffer less at the peak of backward; the head's logits feed
    nothing else that keeps them for backward)."""
    return cross_entropy(logits, target, inplace_grad=True, vocab_size=vocab_size)
