"""The GPT's configuration is the ``model`` config section itself (:class:`trainer.config.ModelConfig`).

``GPTConfig`` names that class for model code; ``trainer.main`` fills ``vocab_size`` from the tokenizer
before building the model. The kernel set (the top-level ``kernels`` key) is passed to the GPT
separately, and the vocabulary padding rule is :func:`trainer.formulas.padded_vocab_size`.
"""

from __future__ import annotations

from trainer.config.model import ATTENTION_BACKENDS, ModelConfig
from trainer.formulas import padded_vocab_size

GPTConfig = ModelConfig

__all__ = ["ATTENTION_BACKENDS", "GPTConfig", "padded_vocab_size"]
