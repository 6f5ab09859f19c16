"""Count the activation bytes autograd keeps for backward: the measurement behind the plan's memory
estimate (trainer.formulas.ACTIVATION_PROFILES; bench/recompute.py, tests/model/test_activation_memory.py).

A ``saved_tensors_hooks`` pack hook sees every tensor autograd saves; each storage is counted once (views
of one buffer are one allocation) and the parameters' storages are excluded (they are weights, counted
by the optimizer's table, not activations). The count is exact and does not depend on the device's
allocator, so a CPU measurement predicts what a layer keeps on any device with the same kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


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
