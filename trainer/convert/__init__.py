"""Hugging Face conversion, both ways, verified (formats.md §4–5).

- ``python -m trainer.convert.to_hf``: a Slipway/Megatron checkpoint at any (tp, pp) → GPT2LMHeadModel dir.
- ``python -m trainer.convert.from_hf``: a GPT2LMHeadModel dir → a Slipway checkpoint at any (tp, pp).
- :func:`convert_run`: the post-job hook (``<run_dir>/hf/`` + ``sample.txt``).

The name map (:mod:`trainer.convert.names`) is declarative and both directions derive from it.
transformers is imported only when a conversion runs.
"""

from __future__ import annotations

import importlib
from typing import Any

# Resolved on first use so that ``python -m trainer.convert.to_hf`` does not import to_hf twice.
_EXPORTS = {"ConvertRunConfig": "run_config", "HubUnavailable": "hub", "convert_run": "hook",
            "CheckpointError": "shard_io", "ConversionResult": "to_hf", "ToHFConfig": "to_hf",
            "VerificationFailed": "to_hf", "convert_checkpoint": "to_hf"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trainer.convert' has no attribute {name!r}")
    return getattr(importlib.import_module(f"trainer.convert.{_EXPORTS[name]}"), name)
