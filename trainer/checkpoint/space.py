"""Disk space for checkpoints: how many bytes a shard needs.

Used by :mod:`trainer.checkpoint` to refuse a save that cannot fit before anything is written; whether an
error means a full disk is :func:`trainer.disk.out_of_space` (torch-free, shared with preprocessing).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def state_bytes(state: Any) -> int:
    """Bytes ``torch.save`` writes for ``state``, from above: every tensor storage once (torch.save writes
    whole storages), plus a per-record allowance for the zip headers, alignment and the pickled rest."""
    seen: set[int] = set()
    total, stack = 64 * 1024, [state]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
            total += 1024
        elif isinstance(obj, dict):
            stack.extend(obj.values())
            total += 64 * len(obj)
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, (str, bytes)):
            total += len(obj)
    return total


def sum_over_ranks(values: list[int]) -> list[int]:
    """Element-wise sum over all ranks (float64: exact up to 2^53 bytes)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return [int(v) for v in t.tolist()]
