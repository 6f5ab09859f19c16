"""Activation recomputation (Megatron's ``--recompute-granularity``): keep fewer activations for backward
and compute them again there, with the same dropout masks so that the math does not change at all.

- ``selective`` (``--recompute-activations``): the core attention — scores, softmax, dropout, ·V — is not
  stored but recomputed in backward; its s² tensors are the large ones (Korthikanti et al. 2022). With
  SDPA's flash or memory-efficient kernels (GPU) those s² tensors are never stored in the first place, so
  there selective saves almost nothing and costs one more attention forward: use it with
  ``model.attention_backend=softmax`` or where SDPA runs its math path (CPU).
- ``full`` with ``method=uniform`` (``--recompute-method uniform``): the stage's layers in groups of
  ``num_layers``, each group keeping only its input; ``method=block``: the first ``num_layers`` layers of
  the stage keep only their inputs, the others store everything (``--recompute-method block``).

Randomness: :func:`torch.utils.checkpoint.checkpoint` restores the default generators for the
recomputation; the model-parallel tracker's named states (dropout inside sharded regions) are restored by
the ``rng`` object handed in from outside (``snapshot()``/``restore()``; the parallel engine passes its
``RNGTracker``), so recomputed dropout draws exactly the masks of the first forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils.checkpoint import checkpoint

from trainer.config.train import RECOMPUTE_GRANULARITIES as GRANULARITIES
from trainer.config.train import RECOMPUTE_METHODS as METHODS


class RNGStates(Protocol):
    """Generator states beyond the default ones that dropout may draw from (the TP tracker's)."""

    def snapshot(self) -> Any: ...

    def restore(self, state: Any) -> None: ...


@dataclass(frozen=True)
class Recompute:
    """What a stage recomputes (``train.recompute_*``; validated there)."""

    granularity: str = "none"
    method: str = "uniform"
    num_layers: int = 1

    def groups(self, n_layers: int) -> list[tuple[int, int, bool]]:
        """This stage's layers as (start, end, recomputed) runs, in order."""
        if self.granularity != "full":
            return [(0, n_layers, False)]
        k = max(1, min(self.num_layers, n_layers))
        if self.method == "uniform":
            return [(i, min(i + k, n_layers), True) for i in range(0, n_layers, k)]
        return [(i, i + 1, True) for i in range(k)] + ([(k, n_layers, False)] if k < n_layers else [])


Contexts = tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]


NO_RECOMPUTE = Recompute()


def _contexts(rng: RNGStates | None) -> Contexts:
    """(forward, recompute) contexts: the tracker's states at the forward, put back for the recompute."""
    saved: dict[str, Any] = {}

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        saved["state"] = rng.snapshot() if rng is not None else None
        yield

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        if rng is None:
            yield
            return
        now = rng.snapshot()
        rng.restore(saved["state"])
        try:
            yield
        finally:
            rng.restore(now)  # backward must not rewind the forward's progress through the streams

    return forward(), recompute()


def recomputed(fn: Callable[..., torch.Tensor], *args: Any, rng: RNGStates | None = None) -> torch.Tensor:
    """``fn(*args)`` storing only its inputs; run again in backward with the same randomness."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True,
                      context_fn=lambda: _contexts(rng))


def apply(model: Any, settings: Recompute, rng: RNGStates | None = None) -> None:
    """Switch ``model`` (a GPT stage) to ``settings``; ``rng``: the extra generator states dropout may
    use (the TP tracker), restored around every recomputation."""
    if settings.granularity not in GRANULARITIES or settings.method not in METHODS:
        raise ValueError(f"recompute granularity={settings.granularity!r} method={settings.method!r}: use "
                         f"one of {GRANULARITIES} and {METHODS}")
    model.encoder.recompute, model.encoder.recompute_rng = settings, rng
    for layer in model.encoder.layers:
        attention = layer.self_attention
        attention.recompute, attention.recompute_rng = settings.granularity == "selective", rng
