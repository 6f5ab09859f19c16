"""Data parallelism: gradients live in flat per-bucket buffers, all-reduced (averaged) across the DP group.

Every parameter's ``.grad`` is a view into one bucket's buffer, so autograd accumulates micro-batch
gradients in place and a bucket is all-reduced with one collective. Buckets are filled in reverse
parameter order — roughly the order backward produces gradients — and, with ``overlap_grad_reduce``,
a post-accumulate-grad hook launches a bucket's asynchronous all-reduce as soon as all its gradients of
the *last* micro-batch are in (PyTorch DDP / Megatron's distributed optimizer buffers), overlapping
communication with the rest of backward. Buckets are launched strictly in index order so that every DP
rank issues the same collectives in the same order. :meth:`GradBuffers.finish` launches what is left and
waits. Never set ``.grad`` to None (``optimizer.zero_grad(set_to_none=True)``): :meth:`zero` re-attaches
the views if that happened, at the cost of losing nothing but speed.

With the distributed optimizer (``shard=True``, trainer.parallel.dist_optimizer) each bucket is padded to
a multiple of dp and its collective is a reduce-scatter: rank r ends up with the averaged gradient of its
shard (``comm.shard_range``) only. With ``grad_dtype`` fp32 for 16-bit parameters (Megatron's
``main_grad``), ``.grad`` is not a view: the post-accumulate-grad hook adds each micro-batch's 16-bit
``.grad`` into the fp32 buffer and frees it, so gradients still accumulate in fp32. :meth:`main_grad` is
a parameter's fp32 view in either case.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from trainer.parallel import comm
from trainer.parallel.state import Group


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    offsets: list[int] = field(default_factory=list)
    """Where each parameter starts in ``buffer``."""
    ready: int = 0
    work: object = field(default=None, repr=False)


class GradBuffers:
    """Flat gradient buckets for ``params`` and their DP all-reduce (a no-op for dp_size 1)."""

    def __init__(self, params: list[nn.Parameter], dp_group: Group, bucket_size_mb: float = 25.0,
                 overlap: bool = True, shard: bool = False, grad_dtype: torch.dtype | None = None) -> None:
        self.dp_group = dp_group
        self.shard = shard
        """Reduce-scatter into this rank's shard (distributed optimizer) instead of all-reducing."""
        self.grad_dtype = grad_dtype
        """Buffer dtype; when it differs from a parameter's, ``.grad`` is folded into the buffer by hook."""
        self._hooks: list = []
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        self._view_of: dict[int, torch.Tensor] = {}
        self.sync_enabled = False
        """Set by the schedule for the last micro-batch's backward: hooks launch reductions only then."""
        self.launched_in_backward = 0
        """Buckets whose all-reduce started inside backward in the last step (overlap actually happened)."""
        self._next = 0
        self._build(params, int(bucket_size_mb * 2**20))
        self._overlap = overlap and dp_group.size > 1
        if self._overlap or any(self._folds(p) for p in params):
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    def _folds(self, p: nn.Parameter) -> bool:
        return self.grad_dtype is not None and p.dtype != self.grad_dtype

    def remove_hooks(self) -> None:
        """Detach the hooks (before replacing these buffers by others over the same parameters)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def main_grad(self, p: nn.Parameter) -> torch.Tensor:
        """The parameter's gradient in its bucket (fp32 for 16-bit parameters with ``grad_dtype``)."""
        return self._view_of[id(p)]

    def shard_range(self, bucket: _Bucket) -> tuple[int, int]:
        """This rank's part of a bucket (all of it unless ``shard``)."""
        if not self.shard:
            return 0, bucket.buffer.numel()
        return comm.shard_range(bucket.buffer.numel(), self.dp_group.size, self.dp_group.index)

    def shard_segments(self, bucket: _Bucket):
        """(param, start, end) for every parameter overlapping this rank's shard, ``start:end`` being the
        overlap in bucket coordinates: a parameter straddling a shard boundary appears on two ranks."""
        lo, hi = self.shard_range(bucket)
        for p, off in zip(bucket.params, bucket.offsets, strict=True):
            start, end = max(lo, off), min(hi, off + p.numel())
            if start < end:
                yield p, start, end

    @torch.no_grad()
    def gather_full(self, p: nn.Parameter) -> torch.Tensor:
        """``main_grad(p)`` complete on every DP rank: after a reduce-scatter only the shard is; this
        all-gathers p's bucket (the tied embedding needs the full reduced gradient, see finish_grad_sync)."""
        if self.shard:
            comm.all_gather_shard(self._bucket_of[id(p)].buffer, self.dp_group, async_op=False)
        return self.main_grad(p)

    def _build(self, params: list[nn.Parameter], bucket_bytes: int) -> None:
        current: list[nn.Parameter] = []
        for p in reversed(params):
            size = torch.empty((), dtype=self.grad_dtype or p.dtype).element_size()  # of the buffer
            if current and (p.dtype != current[0].dtype or p.device != current[0].device
                            or sum(q.numel() for q in current) * size >= bucket_bytes):
                self._add_bucket(current)
                current = []
            current.append(p)
        if current:
            self._add_bucket(current)

    def _add_bucket(self, params: list[nn.Parameter]) -> None:
        numel = sum(p.numel() for p in params)
        if self.shard:  # Megatron pads each bucket to a multiple of dp: equal shards
            numel = comm.padded_numel(numel, self.dp_group.size)
        buffer = torch.zeros(numel, dtype=self.grad_dtype or params[0].dtype, device=params[0].device)
        views, offsets, offset = [], [], 0
        for p in params:
            views.append(buffer[offset: offset + p.numel()].view_as(p))
            offsets.append(offset)
            offset += p.numel()
        bucket = _Bucket(params, buffer, views, offsets)
        self.buckets.append(bucket)
        for p, view in zip(params, views, strict=True):
            self._bucket_of[id(p)] = bucket
            self._view_of[id(p)] = view

    @torch.no_grad()
    def zero(self) -> None:
        """Zero all gradients in place (and make sure every ``.grad`` is its bucket view again)."""
        for bucket in self.buckets:
            bucket.buffer.zero_()
            bucket.ready, bucket.work = 0, None
            for p, view in zip(bucket.params, bucket.views, strict=True):
                if self._folds(p):
                    p.grad = None  # the hook folds each micro-batch's 16-bit .grad into the view
                elif p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
        self._next = 0
        self.launched_in_backward = 0

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if self._folds(param):  # accumulate in fp32 (Megatron's main_grad), free the 16-bit gradient
            with torch.no_grad():
                self.main_grad(param).add_(param.grad)
            param.grad = None
        if not self.sync_enabled or not self._overlap:
            return
        bucket = self._bucket_of[id(param)]
        bucket.ready += 1
        while self._next < len(self.buckets) and \
                self.buckets[self._next].ready == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])
            self.launched_in_backward += 1

    def _launch(self, bucket: _Bucket) -> None:
        bucket.buffer.div_(self.dp_group.size)  # average: each rank's loss is its own micro-batch mean
        if self.shard:
            bucket.work = comm.reduce_scatter_shard(bucket.buffer, self.dp_group)
        else:
            bucket.work = dist.all_reduce(bucket.buffer, group=self.dp_group.pg, async_op=True)
        self._next += 1

    def finish(self) -> None:
        """Launch the buckets not yet launched, in order, and wait for all reductions."""
        self.sync_enabled = False
        if self.dp_group.size == 1:
            return
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.work, bucket.ready = None, 0
        self._next = 0
