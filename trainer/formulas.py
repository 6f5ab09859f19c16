"""Torch-free formulas the trainer and the orchestrator share (one definition each)."""

from __future__ import annotations


def padded_vocab_size(vocab_size: int, tp_size: int = 1, divisible_by: int = 128) -> int:
    """Megatron's rule: round the vocab up to a multiple of ``divisible_by · tp_size``.

    32768 stays 32768 (tp ≤ 256); GPT-2's 50257 becomes 50304. The padded rows are zero and their
    logits are excluded from the loss (see trainer.model.gpt), so the padding never changes the math.
    """
    unit = divisible_by * tp_size
    return -(-vocab_size // unit) * unit


def flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Megatron's model FLOPs for one iteration of ``batch`` sequences, forward and backward, no
    activation recomputation (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
    GPU Clusters", eq. 3): ``72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))``.

    ``vocab`` is the PADDED vocabulary (:func:`padded_vocab_size`): the logit matmul runs over every
    embedding row, padding included, so that is the work the GPU does. The trainer's logged TFLOP/s and
    the orchestrator's run-time estimate both pass it, so the two agree.

    The formula assumes the MLP width ``ffn_hidden_size = 4h``: 72 = 3 (forward, backward at 2×) × 24 per
    layer, and 16 of those 24 are the MLP's two h×4h matmuls. ``model.ffn_hidden_size`` defaults to 4h
    but may be set otherwise; the formula is kept as Megatron has it (so the numbers compare with
    Megatron's logs), and for such a model the reported TFLOP/s and MFU are off by the MLP's share.
    """
    return 72.0 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))
