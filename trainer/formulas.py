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


def activation_bytes_per_layer(seq: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none") -> float:
    """Bytes one transformer layer keeps for backward per micro-batch with 16-bit activations
    (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", table 2):
    ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` with tensor parallelism t, ``s·b·h·(34 + 5·a·s/h)/t`` with
    sequence parallelism too; selective recomputation drops the ``5·a·s/h`` attention term; full keeps
    only the layer's input, ``2·s·b·h`` (``/t`` with sequence parallelism)."""
    sbh = seq * micro_batch * hidden
    attention = 5 * heads * seq / hidden
    if recompute == "full":
        return 2 * sbh / (tp if sequence_parallel else 1)
    if recompute == "selective":
        attention = 0.0
    if sequence_parallel:
        return sbh * (34 + attention) / tp
    return sbh * (10 + 24 / tp + attention / tp)


def stage_activation_bytes(layers: int, seq: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                           sequence_parallel: bool = False, granularity: str = "none",
                           method: str = "uniform", recompute_layers: int = 1) -> float:
    """One pipeline stage's ``layers`` for one micro-batch, by Megatron's recompute methods: full
    ``uniform`` keeps the input of each group of ``recompute_layers`` layers, ``block`` recomputes the
    first ``recompute_layers`` layers and stores the rest in full. (The layers being recomputed during
    backward need one layer group's full activations transiently; not counted, as in the paper.)"""
    def per(kind: str) -> float:
        return activation_bytes_per_layer(seq, micro_batch, hidden, heads, tp, sequence_parallel, kind)

    if granularity != "full":
        return layers * per(granularity)
    k = max(1, min(recompute_layers, layers))
    if method == "uniform":
        return -(-layers // k) * per("full")
    return k * per("full") + (layers - k) * per("none")


def state_bytes_per_param(precision: str, distributed: bool = False,
                          dp: int = 1) -> tuple[float, float, float]:
    """(weights, gradients, optimizer state) bytes per parameter on one device, as Slipway keeps them.

    Without ``optim.distributed`` every precision keeps fp32 parameters (they are the master weights;
    bf16/fp16 run under autocast, trainer.optim.precision), fp32 gradients and two fp32 Adam moments:
    4 + 4 + 8 = 16. With ``optim.distributed`` (ZeRO-1, Megatron's ``--use-distributed-optimizer``) the
    optimizer state is sharded over the ``dp`` data-parallel ranks, as in Megatron's table
    (docs/source/api-guide/dist_optimizer.md): fp32 keeps 4 + 4 + 8/d; bf16/fp16 keep 16-bit parameters,
    fp32 gradient buffers and an fp32 master copy beside the moments, 2 + 4 + 12/d (18 → 6 + 12/d)."""
    if not distributed:
        return 4.0, 4.0, 8.0
    d = max(int(dp), 1)
    if precision == "fp32":
        return 4.0, 4.0, 8.0 / d
    return 2.0, 4.0, 12.0 / d


def bubble_fraction(pp: int, num_microbatches: int, virtual_pp: int = 1) -> float:
    """Idle fraction of a pipelined step, ``(p − 1)/(v·m)`` of the ideal time (Narayanan et al. 2021,
    §2.2.1–2.2.2): the step takes ``(1 + (p − 1)/(v·m))`` times the work of one stage's micro-batches."""
    if pp <= 1:
        return 0.0
    return (pp - 1) / (max(virtual_pp, 1) * max(num_microbatches, 1))


def interleaved_memory_factor(pp: int, virtual_pp: int = 1) -> float:
    """How much more activation memory the first stage holds with the interleaved schedule than with
    1F1B: ``1 + (p − 1)/(p·v)`` (Megatron's ``report_theoretical_memory``); 1 without interleaving."""
    if virtual_pp <= 1 or pp <= 1:
        return 1.0
    return 1 + (pp - 1) / (pp * virtual_pp)
