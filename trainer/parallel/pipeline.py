"""Pipeline parallelism: point-to-point exchange between neighbouring stages and the schedules.

A schedule drives a :class:`StageRunner` (anything with ``forward(x) -> y`` for the next micro-batch and
``backward(x, y, dy) -> dx`` for the oldest one in flight) and a :class:`P2P`. Activations travel
forward as [s(/tp), b, h] tensors of one fixed shape and dtype, gradients of the same shape travel back;
the first stage receives nothing (it reads tokens), the last sends nothing (it computes the loss).
Sends and receives that neighbours perform at the same moment are posted together and then awaited, so
that no stage blocks on a send its neighbour is not yet receiving (Narayanan et al. 2021, §2.2).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import torch
import torch.distributed as dist

from trainer.parallel.state import ParallelState

Tensor = torch.Tensor


class StageRunner(Protocol):
    def forward(self, x: Tensor | None) -> Tensor: ...
    def backward(self, x: Tensor | None, y: Tensor, dy: Tensor | None) -> Tensor | None: ...


class P2P:
    """Activation/gradient exchange with the previous and next pipeline stage (same tp and dp rank)."""

    def __init__(self, pstate: ParallelState, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.pstate, self.shape, self.dtype = pstate, shape, dtype
        group = pstate.pp_group.pg
        self._batched = group is not None and dist.get_backend(group) == "nccl"

    def _exchange(self, to_next: Tensor | None = None, to_prev: Tensor | None = None,
                  from_next: bool = False, from_prev: bool = False) -> tuple[Tensor | None, Tensor | None]:
        ps, group = self.pstate, self.pstate.pp_group.pg
        ops, got_next, got_prev = [], None, None
        if to_prev is not None:
            ops.append((dist.isend, to_prev.detach().to(self.dtype).contiguous(), ps.prev_rank))
        if from_prev:
            got_prev = torch.empty(self.shape, dtype=self.dtype, device=ps.device)
            ops.append((dist.irecv, got_prev, ps.prev_rank))
        if to_next is not None:
            ops.append((dist.isend, to_next.detach().to(self.dtype).contiguous(), ps.next_rank))
        if from_next:
            got_next = torch.empty(self.shape, dtype=self.dtype, device=ps.device)
            ops.append((dist.irecv, got_next, ps.next_rank))
        if self._batched:  # NCCL needs paired send/recv grouped into one call to avoid deadlock
            works = dist.batch_isend_irecv([dist.P2POp(op, t, peer, group) for op, t, peer in ops])
        else:
            works = [op(t, peer, group=group) for op, t, peer in ops]
        for work in works:
            work.wait()
        return got_next, got_prev

    def recv_forward(self) -> Tensor | None:
        if self.pstate.is_first_stage:
            return None
        return self._exchange(from_prev=True)[1].requires_grad_()

    def send_forward(self, y: Tensor) -> None:
        if not self.pstate.is_last_stage:
            self._exchange(to_next=y)

    def recv_backward(self) -> Tensor | None:
        return None if self.pstate.is_last_stage else self._exchange(from_next=True)[0]

    def send_backward(self, dx: Tensor | None) -> None:
        if not self.pstate.is_first_stage:
            self._exchange(to_prev=dx)

    def send_forward_recv_backward(self, y: Tensor) -> Tensor | None:
        if self.pstate.is_last_stage:
            return None
        return self._exchange(to_next=y, from_next=True)[0]

    def send_backward_recv_forward(self, dx: Tensor | None) -> Tensor | None:
        if self.pstate.is_first_stage:
            return None
        return self._exchange(to_prev=dx, from_prev=True)[1].requires_grad_()


def one_forward_one_backward(runner: StageRunner, p2p: P2P, num_microbatches: int) -> None:
    """1F1B (PipeDream-flush): at most ``pp_size - pp_rank`` micro-batches' activations alive per stage."""
    ps, m = p2p.pstate, num_microbatches
    num_warmup = min(ps.pp_size - ps.pp_rank - 1, m)
    num_steady = m - num_warmup
    in_flight: deque[tuple[Tensor | None, Tensor]] = deque()

    # Warm-up: forwards only. Stage k runs p-k-1 of them, so that the last stage can start its first
    # backward as soon as it has done its first forward, and every earlier stage is then busy.
    for _ in range(num_warmup):
        x = p2p.recv_forward()
        y = runner.forward(x)
        p2p.send_forward(y)
        in_flight.append((x, y))

    # Steady state: one forward, then one backward of the oldest micro-batch in flight. The send of this
    # forward's output is paired with the receive of that backward's gradient (and vice versa), so both
    # neighbours exchange in one step.
    x = p2p.recv_forward() if num_steady else None
    for i in range(num_steady):
        y = runner.forward(x)
        dy = p2p.send_forward_recv_backward(y)
        in_flight.append((x, y))
        x_old, y_old = in_flight.popleft()
        dx = runner.backward(x_old, y_old, dy)
        if i == num_steady - 1:
            x = None
            p2p.send_backward(dx)
        else:
            x = p2p.send_backward_recv_forward(dx)

    # Cool-down: the backwards of the warm-up micro-batches, as their gradients arrive from downstream.
    for _ in range(num_warmup):
        x_old, y_old = in_flight.popleft()
        dy = p2p.recv_backward()
        p2p.send_backward(runner.backward(x_old, y_old, dy))


def all_forward_all_backward(runner: StageRunner, p2p: P2P, num_microbatches: int) -> None:
    """GPipe order: every forward, then every backward (first in, first out). Simple; all m micro-batches'
    activations are alive at once. Kept as the reference the 1F1B schedule is checked against."""
    in_flight: deque[tuple[Tensor | None, Tensor]] = deque()

    # Forward phase: the pipeline fills and every micro-batch's activations stay alive.
    for _ in range(num_microbatches):
        x = p2p.recv_forward()
        y = runner.forward(x)
        p2p.send_forward(y)
        in_flight.append((x, y))

    # Backward phase: in the same order, gradients flow back stage by stage.
    for _ in range(num_microbatches):
        x_old, y_old = in_flight.popleft()
        dy = p2p.recv_backward()
        p2p.send_backward(runner.backward(x_old, y_old, dy))


def forward_only(runner: StageRunner, p2p: P2P, num_microbatches: int) -> None:
    """Evaluation: forwards without autograd, passed down the pipeline."""
    with torch.no_grad():
        for _ in range(num_microbatches):
            p2p.send_forward(runner.forward(p2p.recv_forward()))


SCHEDULES = {"1f1b": one_forward_one_backward, "afab": all_forward_all_backward}
