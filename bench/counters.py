"""Memory counters behind the plan's estimates, measured from real tensors (bench and tests only; no
run of the product uses them).

- :func:`saved_activation_bytes`: the activation bytes autograd keeps for backward, behind
  ``trainer.memory_formulas.ACTIVATION_PROFILES`` (bench/recompute.py, tests/model/test_activation_memory.py).
  A ``saved_tensors_hooks`` pack hook sees every tensor autograd saves; each storage is counted once
  (views of one buffer are one allocation) and the parameters' storages are excluded (weights, counted
  by the optimizer's table). Exact and allocator-independent, so a CPU count predicts any device with
  the same kernels.
- :func:`measure_state_bytes`: bytes per parameter one rank holds for training state, read off the
  storages: parameters (weights), gradient buckets and any ``.grad`` outside them, and the optimizer's
  tensors not already counted (the distributed optimizer's fp32 master shards, a view of the weights for
  fp32, and moments; a torch optimizer's ``state``). Compared with
  ``trainer.memory_formulas.state_bytes_per_param`` by bench/dist_optim.py and its test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from trainer.parallel.dist_optimizer import DistributedOptimizer


def saved_activation_bytes(params: Iterable[torch.Tensor], run: Callable[[], object]) -> int:
    """Bytes of the distinct storages autograd saves while ``run()`` runs, ``params``' excluded."""
    excluded = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in excluded:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


@dataclass(frozen=True)
class StateBytes:
    """Bytes on this rank, and the parameter elements of its model shard."""

    weights: int
    gradients: int
    optimizer: int
    params: int

    def per_param(self) -> tuple[float, float, float]:
        return (self.weights / self.params, self.gradients / self.params, self.optimizer / self.params)


class _Counter:
    def __init__(self) -> None:
        self.seen: set[int] = set()

    def add(self, tensors) -> int:
        total = 0
        for t in tensors:
            if not torch.is_tensor(t):
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() not in self.seen:
                self.seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total


def measure_state_bytes(model, optimizer) -> StateBytes:
    """What ``model`` (a ParallelModel) and ``optimizer`` (plain or distributed) hold on this rank; run a
    step first so that a lazily initialised optimizer has its state."""
    c, params = _Counter(), model.parameters()
    weights = c.add(params)
    gradients = c.add([b.buffer for b in model.grads.buckets]) + c.add([p.grad for p in params])
    if isinstance(optimizer, DistributedOptimizer):
        state = [t for s in optimizer.shards for t in (s.master, s.exp_avg, s.exp_avg_sq)]
    else:
        state = [v for st in optimizer.state.values() for v in st.values()]
    return StateBytes(weights, gradients, c.add(state), sum(p.numel() for p in params))
