"""The interleaved 1F1B schedule (virtual pipeline stages; Narayanan et al. 2021, §2.2.2; Megatron's
``forward_backward_pipelining_with_interleaving``).

Each pipeline rank holds v model chunks (``sharding.stage_layers``: chunk c of rank r is chunk number
c·p + r of the p·v equal blocks of layers), so a micro-batch goes round the ring of ranks v times:
rank p−1's chunk c feeds rank 0's chunk c+1, and gradients come back the same way. Each rank runs its
m·v (chunk, micro-batch) forwards in groups of p micro-batches per chunk — forward k runs chunk
:func:`chunk_id` (k) — and its backwards in the mirrored chunk order. The bubble shrinks from
(p−1)/m to (p−1)/(v·m) of the ideal step (``trainer.time_formulas.bubble_fraction``) at the price of v times
the point-to-point messages and more warm-up activations on early ranks
(``memory_formulas.interleaved_memory_factor``).

The schedules drive a :class:`ChunkRunner` (``forward(x, chunk)`` for that chunk's next micro-batch,
``backward(x, y, dy, chunk)`` for its oldest one in flight) and a :class:`RingP2P`. As in Megatron, the
point-to-point pattern is derived from the same chunk arithmetic on both ends, so each rank knows which
chunk a received tensor belongs to without sending any header.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import torch
import torch.distributed as dist

from trainer.parallel.pipeline import P2P
from trainer.parallel.state import ParallelState

Tensor = torch.Tensor

# gloo matches a receive to the sender's messages of the same tag in order. With p=2 both neighbours are
# the same rank, so activations (to next / from prev) and gradients (to prev / from next) travel the same
# link in both directions: distinct tags keep the two streams apart. NCCL ignores tags and matches the
# ops to one peer in posting order, so every exchange posts activation ops before gradient ops, the
# same order on both ends.
ACTIVATION_TAG, GRADIENT_TAG = 0, 1


class ChunkRunner(Protocol):
    def forward(self, x: Tensor | None, chunk: int) -> Tensor: ...
    def backward(self, x: Tensor | None, y: Tensor, dy: Tensor | None, chunk: int) -> Tensor | None: ...


class RingP2P(P2P):
    """Exchange with the previous and next pipeline rank on the *ring* (rank p−1's next is rank 0): the
    last rank's chunk c sends to the first rank's chunk c+1. Whether a chunk sends or receives at all is
    the schedule's decision (first chunk of rank 0 reads tokens, last chunk of rank p−1 makes the loss)."""

    def __init__(self, pstate: ParallelState, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__(pstate, shape, dtype)
        ranks, r = pstate.pp_group.ranks, pstate.pp_rank
        self.prev_rank, self.next_rank = ranks[(r - 1) % len(ranks)], ranks[(r + 1) % len(ranks)]

    def _exchange(self, to_next: Tensor | None = None, to_prev: Tensor | None = None,
                  from_next: bool = False, from_prev: bool = False) -> tuple[Tensor | None, Tensor | None]:
        ops, got_next, got_prev = [], None, None
        if to_next is not None:  # activations first, then gradients (see ACTIVATION_TAG)
            ops.append((dist.isend, self._wire(to_next), self.next_rank, ACTIVATION_TAG))
        if from_prev:
            got_prev = self._buffer()
            ops.append((dist.irecv, got_prev, self.prev_rank, ACTIVATION_TAG))
        if to_prev is not None:
            ops.append((dist.isend, self._wire(to_prev), self.prev_rank, GRADIENT_TAG))
        if from_next:
            got_next = self._buffer()
            ops.append((dist.irecv, got_next, self.next_rank, GRADIENT_TAG))
        group = self.pstate.pp_group.pg
        if self._batched:  # NCCL: paired send/recv in one group call, or neighbours deadlock
            works = dist.batch_isend_irecv([dist.P2POp(op, t, peer, group, tag) for op, t, peer, tag in ops])
        else:
            works = [op(t, peer, group=group, tag=tag) for op, t, peer, tag in ops]
        for work in works:
            work.wait()
        return got_next, got_prev

    def _wire(self, t: Tensor) -> Tensor:
        return t.detach().to(self.dtype).contiguous()

    def _buffer(self) -> Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.pstate.device)

    def exchange(self, y: Tensor | None, dx: Tensor | None, recv_prev: bool, recv_next: bool
                 ) -> tuple[Tensor | None, Tensor | None]:
        """Send ``y`` forward and ``dx`` back (None: nothing), receive (activation, gradient) as asked."""
        if y is None and dx is None and not recv_prev and not recv_next:
            return None, None
        got_next, got_prev = self._exchange(to_next=y, to_prev=dx, from_next=recv_next, from_prev=recv_prev)
        return (None if got_prev is None else got_prev.requires_grad_()), got_next


def chunk_id(k: int, pp_size: int, num_chunks: int, forward: bool) -> int:
    """The chunk of a rank's k-th forward (or backward): micro-batches go in groups of p per chunk,
    chunks ascending for forwards and descending for backwards (Megatron's get_model_chunk_id)."""
    chunk = (k % (pp_size * num_chunks)) // pp_size
    return chunk if forward else num_chunks - 1 - chunk


def num_warmup(pp_size: int, pp_rank: int, num_chunks: int, num_microbatches: int) -> int:
    """Forwards a rank runs before its first backward: (p − r − 1)·2 + (v − 1)·p, at most m·v.

    Rank r must fill the ring until the last rank's last chunk has produced a loss: (v − 1)·p forwards
    for the other chunks' first groups, and twice its distance to the last rank, because in the steady
    state each rank's forward and backward are exchanged together after both have run. With m = p
    Megatron runs every forward first (there is no steady state to gain)."""
    total = num_microbatches * num_chunks
    if num_microbatches == pp_size:
        return total
    return min((pp_size - pp_rank - 1) * 2 + (num_chunks - 1) * pp_size, total)


class _Chunks:
    """One rank's queues per chunk: received inputs and gradients not yet used, and (x, y) in flight."""

    def __init__(self, runner: ChunkRunner, p2p: RingP2P, num_chunks: int, keep: bool) -> None:
        ps = p2p.pstate
        self.runner, self.p2p, self.v, self.keep = runner, p2p, num_chunks, keep
        self.p, self.r = ps.pp_size, ps.pp_rank
        self.inputs: list[deque[Tensor]] = [deque() for _ in range(num_chunks)]
        self.grads: list[deque[Tensor]] = [deque() for _ in range(num_chunks)]
        self.in_flight: list[deque[tuple[Tensor | None, Tensor]]] = [deque() for _ in range(num_chunks)]

    def chunk(self, k: int, forward: bool) -> int:
        return chunk_id(k, self.p, self.v, forward)

    def is_first(self, chunk: int) -> bool:  # the model's first chunk: reads tokens
        return self.r == 0 and chunk == 0

    def is_last(self, chunk: int) -> bool:  # the model's last chunk: computes the loss
        return self.r == self.p - 1 and chunk == self.v - 1

    def forward(self, k: int) -> Tensor | None:
        """Run forward k; returns what to send downstream (None from the model's last chunk)."""
        c = self.chunk(k, forward=True)
        x = None if self.is_first(c) else self.inputs[c].popleft()
        y = self.runner.forward(x, c)
        if self.keep:
            self.in_flight[c].append((x, y))
        return None if self.is_last(c) else y

    def backward(self, k: int) -> Tensor | None:
        """Run backward k; returns the input gradient to send upstream (None from the first chunk)."""
        c = self.chunk(k, forward=False)
        x, y = self.in_flight[c].popleft()
        dy = None if self.is_last(c) else self.grads[c].popleft()
        dx = self.runner.backward(x, y, dy, c)
        return None if self.is_first(c) else dx

    def received(self, x: Tensor | None, x_chunk: int, dy: Tensor | None, dy_chunk: int) -> None:
        if x is not None:
            self.inputs[x_chunk].append(x)
        if dy is not None:
            self.grads[dy_chunk].append(dy)


def _warmup(s: _Chunks, total: int, warmup: int, then_backward: bool) -> None:
    """Forwards only. Each output goes downstream at once; what arrives from upstream is the input of
    the next forward's chunk, except on rank 0 when that chunk is 0 (it reads tokens). The last warm-up
    exchange also fetches the first gradient for the steady state when one follows."""
    if s.r != 0 and warmup:  # the first forward's input (chunk 0) comes from upstream
        x, _ = s.p2p.exchange(None, None, True, False)
        s.received(x, 0, None, 0)
    for k in range(warmup):
        y = s.forward(k)
        nxt = s.chunk(k + 1, forward=True)
        recv_prev = not (s.r == 0 and nxt == 0) and k < total - 1
        recv_next = then_backward and k == warmup - 1 and s.r != s.p - 1
        x, dy = s.p2p.exchange(y, None, recv_prev, recv_next)
        s.received(x, nxt, dy, s.v - 1)


def _steady(s: _Chunks, total: int, warmup: int) -> None:
    """One forward and one backward, then one exchange carrying both results. Rank 0 is p−1 forwards
    ahead of rank p−1, so what it receives now is rank p−1's output of forward k−(p−1) for the next
    chunk up (nothing if that was the last chunk); symmetrically for the last rank's gradients."""
    remaining = total - warmup
    for k in range(remaining):
        fk = k + warmup
        y, dx = s.forward(fk), s.backward(k)
        if s.r == 0:
            x_chunk = s.chunk(fk - (s.p - 1), forward=True) + 1
            recv_prev = x_chunk < s.v
        else:
            x_chunk, recv_prev = s.chunk(fk + 1, forward=True), True
        if s.r == s.p - 1:
            dy_chunk = s.chunk(k - (s.p - 1), forward=False) - 1
            recv_next = dy_chunk >= 0
        else:
            dy_chunk, recv_next = s.chunk(k + 1, forward=False), True
        recv_prev = recv_prev and k < remaining - 1  # the last forward has run
        x, dy = s.p2p.exchange(y, dx, recv_prev, recv_next)
        s.received(x, x_chunk, dy, dy_chunk)


def _cooldown(s: _Chunks, total: int, warmup: int, fetch_first: bool) -> None:
    """The backwards left, each exchange sending one input gradient up and fetching the next one."""
    if fetch_first and s.r != s.p - 1:  # no warm-up exchange fetched the first gradient
        _, dy = s.p2p.exchange(None, None, False, True)
        s.received(None, 0, dy, s.v - 1)
    for k in range(total - warmup, total):
        dx = s.backward(k)
        nxt = s.chunk(k + 1, forward=False)
        recv_next = not (s.r == s.p - 1 and nxt == s.v - 1) and k < total - 1
        _, dy = s.p2p.exchange(None, dx, False, recv_next)
        s.received(None, 0, dy, nxt)


def _run(runner: ChunkRunner, p2p: RingP2P, m: int, num_chunks: int, all_forward_first: bool) -> None:
    ps = p2p.pstate
    check_microbatches(m, ps.pp_size)
    total = m * num_chunks
    # Megatron's all_warmup_microbatches (m = p, or the reference order): the first gradient is fetched
    # on its own after the forwards; otherwise with the last warm-up forward's exchange (even when the
    # warm-up count was capped at m·v), so that neighbours' exchanges pair up one to one.
    all_first = all_forward_first or m == ps.pp_size
    warmup = total if all_first else num_warmup(ps.pp_size, ps.pp_rank, num_chunks, m)
    s = _Chunks(runner, p2p, num_chunks, keep=True)
    _warmup(s, total, warmup, then_backward=not all_first)
    _steady(s, total, warmup)
    _cooldown(s, total, warmup, fetch_first=all_first)


def check_microbatches(num_microbatches: int, pp_size: int) -> None:
    """The interleaved schedule runs each chunk on groups of p micro-batches (Megatron's rule)."""
    if num_microbatches % pp_size:
        raise ValueError(f"the interleaved pipeline schedule (parallel.virtual_pp_size > 1) needs the "
                         f"micro-batches per step ({num_microbatches}) to be a multiple of parallel.pp_size="
                         f"{pp_size}: change train.global_batch_size (micro-batches = global_batch / "
                         "(micro_batch·dp)) or set parallel.virtual_pp_size=1")


def interleaved_1f1b(runner: ChunkRunner, p2p: RingP2P, num_microbatches: int, num_chunks: int) -> None:
    """Interleaved 1F1B: warm-up forwards, steady one-forward-one-backward, cool-down backwards."""
    _run(runner, p2p, num_microbatches, num_chunks, all_forward_first=False)


def interleaved_afab(runner: ChunkRunner, p2p: RingP2P, num_microbatches: int, num_chunks: int) -> None:
    """Every forward (in the interleaved chunk order), then every backward: the reference the
    interleaved 1F1B gradients are checked against; all m·v activations stay alive."""
    _run(runner, p2p, num_microbatches, num_chunks, all_forward_first=True)


def interleaved_forward_only(runner: ChunkRunner, p2p: RingP2P, num_microbatches: int,
                             num_chunks: int) -> None:
    """Evaluation: the warm-up phase over all m·v forwards, without autograd or kept activations."""
    check_microbatches(num_microbatches, p2p.pstate.pp_size)
    total = num_microbatches * num_chunks
    with torch.no_grad():
        _warmup(_Chunks(runner, p2p, num_chunks, keep=False), total, total, then_backward=False)


INTERLEAVED_SCHEDULES = {"1f1b": interleaved_1f1b, "afab": interleaved_afab}
