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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from trainer.parallel.state import Group


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    ready: int = 0
    work: object = field(default=None, repr=False)


class GradBuffers:
    """Flat gradient buckets for ``params`` and their DP all-reduce (a no-op for dp_size 1)."""

    def __init__(self, params: list[nn.Parameter], dp_group: Group, bucket_size_mb: float = 25.0,
                 overlap: bool = True) -> None:
        self.dp_group = dp_group
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        self.sync_enabled = False
        """Set by the schedule for the last micro-batch's backward: hooks launch reductions only then."""
        self.launched_in_backward = 0
        """Buckets whose all-reduce started inside backward in the last step (overlap actually happened)."""
        self._next = 0
        self._build(params, int(bucket_size_mb * 2**20))
        if overlap and dp_group.size > 1:
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _build(self, params: list[nn.Parameter], bucket_bytes: int) -> None:
        current: list[nn.Parameter] = []
        for p in reversed(params):
            if current and (p.dtype != current[0].dtype or p.device != current[0].device
                            or sum(q.numel() for q in current) * p.element_size() >= bucket_bytes):
                self._add_bucket(current)
                current = []
            current.append(p)
        if current:
            self._add_bucket(current)

    def _add_bucket(self, params: list[nn.Parameter]) -> None:
        buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        views, offset = [], 0
        for p in params:
            views.append(buffer[offset: offset + p.numel()].view_as(p))
            offset += p.numel()
        bucket = _Bucket(params, buffer, views)
        self.buckets.append(bucket)
        for p in params:
            self._bucket_of[id(p)] = bucket

    @torch.no_grad()
    def zero(self) -> None:
        """Zero all gradients in place (and make sure every ``.grad`` is its bucket view again)."""
        for bucket in self.buckets:
            bucket.buffer.zero_()
            bucket.ready, bucket.work = 0, None
            for p, view in zip(bucket.params, bucket.views, strict=True):
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
        self._next = 0
        self.launched_in_backward = 0

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self.sync_enabled:
            return
        bucket = self._bucket_of[id(param)]
        bucket.ready += 1
        while self._next < len(self.buckets) and \
                self.buckets[self._next].ready == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])
            self.launched_in_backward += 1

    def _launch(self, bucket: _Bucket) -> None:
        bucket.buffer.div_(self.dp_group.size)  # average: each rank's loss is its own micro-batch mean
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
