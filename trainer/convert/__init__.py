"""Hugging Face conversion, both ways, verified (formats.md §4–5).

- ``python -m trainer.convert.to_hf``: a Slipway/Megatron checkpoint at any (tp, pp) → GPT2LMHeadModel dir.
- ``python -m trainer.convert.from_hf``: a GPT2LMHeadModel dir → a Slipway checkpoint at any (tp, pp).
- :func:`convert_run`: the post-job hook (``<run_dir>/hf/`` + ``sample.txt``).

The name map (:mod:`trainer.convert.names`) is declarative and both directions derive from it.
transformers is imported only when a conversion runs.
"""

from trainer.convert.hook import ConvertRunConfig, HubUnavailable, convert_run
from trainer.convert.layout import CheckpointError
from trainer.convert.to_hf import ConversionResult, ToHFConfig, VerificationFailed, convert_checkpoint

__all__ = ["CheckpointError", "ConversionResult", "ConvertRunConfig", "HubUnavailable", "ToHFConfig",
           "VerificationFailed", "convert_checkpoint", "convert_run"]
