"""Torch-free formulas the trainer and the orchestrator share (one definition each)."""

from __future__ import annotations


def padded_vocab_size(vocab_size: int, tp_size: int = 1, divisible_by: int = 128) -> int:
    """Megatron's rule: round the vocab up to a multiple of ``divisible_by · tp_size``.

    32768 stays 32768 (tp ≤ 256); GPT-2's 50257 becomes 50304. The padded rows are zero and their
    logits are excluded from the loss (see trainer.model.gpt), so the padding never changes the math.
    """
    unit = divisible_by * tp_size
    return -(-vocab_size // unit) * unit
