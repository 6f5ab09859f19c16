"""Model-parallel RNG (Megatron's CudaRNGStatesTracker, device-agnostic).

Dropout must draw the *same* mask where a tensor is replicated across the TP group (the residual stream
without sequence parallelism, the embeddings), else the replicas drift apart; and *different* masks where
a tensor is sharded (attention probabilities are split by head; with sequence parallelism the residual
stream is split by position), else shards would share one pattern. So the default generator is seeded
identically across TP ranks, and sharded regions run inside ``tracker.fork()``, which swaps in a
generator seeded per TP rank. Seeds (as Megatron): default = seed + 100·pp_rank (+ a dp offset, so that
data-parallel replicas do not share masks), tracker = default + 2718 + tp_rank.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch

from trainer.parallel.state import ParallelState

MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_SEED_OFFSET = 2718
_DP_SEED_STRIDE = 1_000_003  # avoids Megatron's seed+10·dp colliding with seed+100·pp


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


class RNGTracker:
    """Named generator states for ``device``, swapped into the default generator by :meth:`fork`."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists")
        self.states[name] = torch.Generator(device=self.device).manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block with the named state as the device's default generator, then advance it."""
        outer = _get_state(self.device)
        _set_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device)
            _set_state(outer, self.device)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """The named states (for activation recomputation, trainer.model.recompute)."""
        return {k: v.clone() for k, v in self.states.items()}

    def restore(self, state: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in state.items()}

    def state_dict(self) -> dict:
        """For checkpoints: the tracker's states and the default generator's (CPU and device)."""
        out = {"tracker": {k: v.clone() for k, v in self.states.items()}, "cpu": torch.get_rng_state()}
        if self.device.type != "cpu":
            out["device"] = _get_state(self.device)
        return out

    def load_state_dict(self, state: dict) -> None:
        self.states = {k: v.clone() for k, v in state["tracker"].items()}
        torch.set_rng_state(state["cpu"])
        if "device" in state and self.device.type != "cpu":
            _set_state(state["device"], self.device)


def seed_everything(seed: int, pstate: ParallelState) -> RNGTracker:
    """Seed the default generators for this rank and return its model-parallel tracker."""
    default_seed = seed + 100 * pstate.pp_rank + _DP_SEED_STRIDE * pstate.dp_rank
    # Python's and NumPy's global generators too, as Megatron's _set_random_seed does: checkpoints save
    # their states, so identical runs must save identical ones (and any use of them repeats).
    random.seed(default_seed)
    np.random.seed(default_seed % 2**32)
    torch.manual_seed(default_seed)  # CPU and every accelerator device
    tracker = RNGTracker(pstate.device)
    tracker.add(MODEL_PARALLEL_RNG, default_seed + _TP_SEED_OFFSET + pstate.tp_rank)
    return tracker
