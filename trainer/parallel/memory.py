"""Bytes per parameter that one rank really holds for training state, read off the tensors' storages.

Counts every storage once (views share one): the parameters' storages (weights), the gradient buckets
and any ``.grad`` outside them (gradients), and the optimizer's tensors not already counted — for the
distributed optimizer its fp32 master shards (a view of the weights for fp32, so not counted twice) and
moments, for a torch optimizer every tensor in its ``state``. Compared with
``trainer.formulas.state_bytes_per_param`` by bench/dist_optim.py and its test.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.parallel.dist_optimizer import DistributedOptimizer


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
