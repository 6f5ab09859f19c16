"""The communication vocabulary of tensor and sequence parallelism: autograd Functions over a Group.

Each is a forward/backward pair (Megatron's f and g and their sequence-parallel cousins). "Region" is the
part of the network between a column-parallel and a row-parallel layer, where activations are sharded:

| function                      | forward                      | backward                     |
|-------------------------------|------------------------------|------------------------------|
| copy_to_region (f)            | identity                     | all-reduce                   |
| reduce_from_region (g)        | all-reduce                   | identity                     |
| scatter_to_sequence           | keep my chunk of dim 0       | all-gather dim 0             |
| gather_from_sequence          | all-gather dim 0             | reduce-scatter dim 0         |
| reduce_scatter_to_sequence    | reduce-scatter dim 0         | all-gather dim 0             |
| gather_last_dim               | all-gather last dim          | keep my chunk of last dim    |

On a one-rank group every function is the identity. Plain (non-autograd) helpers are exported for
gradient synchronisation. Nothing here touches torch.cuda: the same code runs on gloo and NCCL.

The distributed optimizer's flat-buffer collectives (:func:`reduce_scatter_shard`,
:func:`all_gather_shard`) work in place on a buffer padded to a multiple of the group size, where rank r
owns :func:`shard_range` (Megatron's rule). NCCL and gloo both have the native ``reduce_scatter_tensor``
/ ``all_gather_into_tensor`` here (gloo checked on torch 2.13 CPU: sync, async, and with the output a
view of the input), so both use them; ``emulate=True`` gives the same result from ``all_reduce`` (every
rank reduces all, keeps its shard) and a list ``all_gather`` into the buffer's chunks, for a backend
without them (gloo of older torch releases, MPI). Tests compare the two on gloo and on NCCL.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.parallel.state import Group

Tensor = torch.Tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce(x: Tensor, group: Group, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Tensor:
    """In-place all-reduce of ``x`` over ``group``; returns ``x``."""
    if group.size > 1:
        dist.all_reduce(x, op=op, group=group.pg)
    return x


def all_gather_dim0(x: Tensor, group: Group) -> Tensor:
    """Concatenation of every rank's ``x`` along dim 0, in group order."""
    if group.size == 1:
        return x
    out = torch.empty((group.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather(out, x.contiguous(), group=group.pg)
    return out


def reduce_scatter_dim0(x: Tensor, group: Group) -> Tensor:
    """This rank's chunk (dim 0) of the sum of every rank's ``x``."""
    if group.size == 1:
        return x
    if x.shape[0] % group.size:
        raise ValueError(f"dim 0 ({x.shape[0]}) does not divide by the group size {group.size}")
    out = torch.empty((x.shape[0] // group.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter(out, x.contiguous(), group=group.pg)
    return out


def shard_range(numel: int, size: int, index: int) -> tuple[int, int]:
    """The one shard rule of the distributed optimizer: a flat buffer of ``numel`` elements (a multiple
    of ``size``, see :func:`padded_numel`) is split evenly; rank ``index`` owns
    ``[index·n/size, (index+1)·n/size)``."""
    if numel % size:
        raise ValueError(f"a sharded buffer of {numel} elements does not divide by the group size {size}; "
                         "pad it with padded_numel")
    per = numel // size
    return index * per, (index + 1) * per


def padded_numel(numel: int, size: int) -> int:
    """``numel`` rounded up to a multiple of ``size`` (Megatron pads each bucket so)."""
    return -(-numel // size) * size


class _Done:
    """The handle of a collective that has already completed (one-rank groups)."""

    def wait(self) -> bool:
        return True


def reduce_scatter_shard(buffer: Tensor, group: Group, async_op: bool = True, emulate: bool = False):
    """Sum ``buffer`` over ``group`` into this rank's shard of it (in place; the rest of the buffer is
    left undefined). Returns the work handle (``.wait()``)."""
    if group.size == 1:
        return _Done()
    start, end = shard_range(buffer.numel(), group.size, group.index)
    if emulate:
        return dist.all_reduce(buffer, group=group.pg, async_op=async_op) or _Done()
    return _reduce_scatter(buffer[start:end], buffer, group=group.pg, async_op=async_op) or _Done()


def all_gather_shard(buffer: Tensor, group: Group, async_op: bool = True, emulate: bool = False):
    """Fill ``buffer`` with every rank's shard (each rank's own part is its input, in place)."""
    if group.size == 1:
        return _Done()
    start, end = shard_range(buffer.numel(), group.size, group.index)
    if emulate:  # a list all_gather whose outputs are the buffer's chunks: no extra copy of the buffer
        mine = buffer[start:end].clone()  # the input must not alias an output being written
        return dist.all_gather(list(buffer.chunk(group.size)), mine, group=group.pg, async_op=async_op) \
            or _Done()
    return _all_gather(buffer, buffer[start:end], group=group.pg, async_op=async_op) or _Done()


def split_dim(x: Tensor, group: Group, dim: int) -> Tensor:
    """This rank's contiguous chunk of ``x`` along ``dim``."""
    if group.size == 1:
        return x
    if x.shape[dim] % group.size:
        raise ValueError(f"dim {dim} ({x.shape[dim]}) does not divide by the group size {group.size}")
    return x.chunk(group.size, dim=dim)[group.index].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return all_reduce(grad.contiguous().clone(), ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return split_dim(x, group, 0)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return all_gather_dim0(grad, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return reduce_scatter_dim0(grad, ctx.group), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return all_gather_dim0(grad, ctx.group), None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        gathered = all_gather_dim0(x.movedim(-1, 0), group)
        return gathered.movedim(0, -1).contiguous()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return split_dim(grad, ctx.group, grad.dim() - 1), None


def _apply(fn: type[torch.autograd.Function], x: Tensor, group: Group) -> Tensor:
    return x if group.size == 1 else fn.apply(x, group)


def copy_to_region(x: Tensor, group: Group) -> Tensor:
    """f: identity forward, all-reduce backward (input of a column-parallel layer)."""
    return _apply(_CopyToRegion, x, group)


def reduce_from_region(x: Tensor, group: Group) -> Tensor:
    """g: all-reduce forward, identity backward (output of a row-parallel layer)."""
    return _apply(_ReduceFromRegion, x, group)


def scatter_to_sequence(x: Tensor, group: Group) -> Tensor:
    """Keep this rank's chunk of the sequence (dim 0) forward; all-gather it backward."""
    return _apply(_ScatterToSequence, x, group)


def gather_from_sequence(x: Tensor, group: Group) -> Tensor:
    """All-gather the sequence (dim 0) forward; reduce-scatter the gradient backward (SP column input)."""
    return _apply(_GatherFromSequence, x, group)


def reduce_scatter_to_sequence(x: Tensor, group: Group) -> Tensor:
    """Reduce-scatter on dim 0 forward; all-gather backward (SP row-parallel output)."""
    return _apply(_ReduceScatterToSequence, x, group)


def gather_last_dim(x: Tensor, group: Group) -> Tensor:
    """All-gather the last dim forward (e.g. vocab-sharded logits); keep my chunk backward."""
    return _apply(_GatherLastDim, x, group)
