"""Torch-free formulas the trainer and the orchestrator share (one definition each)."""

from __future__ import annotations

from dataclasses import dataclass, replace

PORT_BASE = 20000  # MASTER_PORT of a Slurm job without one: PORT_BASE + job id mod PORT_SPAN, the same on
# every node (the job script exports it; the trainer derives it when run by hand). The span ends where Linux's
# default ephemeral range (32768-60999) begins: a port in it can be held by any outgoing connection on the
# first node, and rank 0 then dies with EADDRINUSE (seen in CI on port 38028).
PORT_SPAN = 32768 - PORT_BASE


def master_port(job_id: int, base: int = PORT_BASE) -> int:
    """The rendezvous port of a Slurm job: distinct for concurrent jobs, known to every node."""
    return base + job_id % PORT_SPAN


def global_batch_size(configured: int | None, micro_batch_size: int, dp_size: int) -> int:
    """train.global_batch_size, or one micro-batch per data-parallel rank when it is null."""
    return micro_batch_size * dp_size if configured is None else configured


def microbatches_per_step(global_batch: int, micro_batch_size: int, dp_size: int) -> int:
    """Micro-batches per step on each rank, global_batch / (micro_batch · dp); 0 when not whole."""
    per_step = micro_batch_size * dp_size
    return global_batch // per_step if per_step > 0 and global_batch % per_step == 0 else 0


def num_microbatches(global_batch: int, micro_batch_size: int, dp_size: int) -> int:
    """:func:`microbatches_per_step`, which the trainer needs whole: a ValueError naming the fix if not."""
    per_step = micro_batch_size * dp_size
    if micro_batch_size < 1 or not microbatches_per_step(global_batch, micro_batch_size, dp_size):
        raise ValueError(f"train.global_batch_size={global_batch} is not a multiple of "
                         f"train.micro_batch_size={micro_batch_size} × dp_size={dp_size} (= {per_step}); "
                         f"pick one that is, e.g. {max(1, global_batch // max(per_step, 1)) * per_step}")
    return microbatches_per_step(global_batch, micro_batch_size, dp_size)


def model_vocab_size(configured: int | None, tokenizer_entries: int | None) -> int | None:
    """The vocabulary the model is built with (before padding): ``model.vocab_size`` when set (it may
    exceed the tokenizer's, to leave room for added tokens), else the tokenizer's entries (Megatron's
    vocab_size). The plan sizes memory and FLOPs with it, the trainer builds with it."""
    return configured or tokenizer_entries or None


def padded_vocab_size(vocab_size: int, tp_size: int = 1, divisible_by: int = 128) -> int:
    """Megatron's rule: round the vocab up to a multiple of ``divisible_by · tp_size``.

    32768 stays 32768 (tp ≤ 256); GPT-2's 50257 becomes 50304. The padded rows are zero and their
    logits are excluded from the loss (see trainer.model.gpt), so the padding never changes the math.
    """
    unit = divisible_by * tp_size
    return -(-vocab_size // unit) * unit


def flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int, *,
                        ffn_hidden_size: int | None = None, num_attention_heads: int = 1,
                        num_query_groups: int | None = None, kv_channels: int | None = None,
                        swiglu: bool = False) -> float:
    """Megatron-LM's model FLOPs for one iteration of ``batch`` sequences, forward and backward, no
    activation recomputation (``megatron.training.training.num_floating_point_operations``, core_v0.8):

        12·B·s·l·h² · [(1 + g/a + s/h)·(a·d/h) + (f/h)·(3/2 if SwiGLU) + V/(2·l·h)]

    with a heads of d = ``kv_channels`` dims (default h/a), g KV groups (grouped-query attention; default
    a), MLP width f (default 4h). 12 = 3 (forward, and backward at twice it) × 2 (multiply-add) × 2 (two
    matmuls of each size); the attention term counts Q and the output projection (1), K and V (g/a) and
    the score and context matmuls (s/h); SwiGLU's three matrices make the MLP 3/2 of two. With the
    defaults this is Narayanan et al. 2021's eq. 3, ``72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))``. An untied
    head adds parameters, not FLOPs: the logit matmul is the same either way.

    ``vocab`` is the PADDED vocabulary (:func:`padded_vocab_size`): the logit matmul runs over every
    embedding row, padding included, so that is the work the GPU does. The trainer's logged TFLOP/s and
    the orchestrator's run-time estimate both get here through :func:`model_flops_per_iteration`, so the
    two agree.
    """
    ffn = 4 * hidden if ffn_hidden_size is None else ffn_hidden_size
    groups = num_attention_heads if num_query_groups is None else num_query_groups
    query_ratio = (num_attention_heads * (kv_channels or hidden // num_attention_heads)) / hidden
    attention = (1 + groups / num_attention_heads + seq / hidden) * query_ratio
    mlp = ffn / hidden * (1.5 if swiglu else 1.0)
    logit = vocab / (2 * layers * hidden)
    return 12.0 * batch * seq * layers * hidden**2 * (attention + mlp + logit)


def model_flops_per_iteration(m, batch: int, padded_vocab: int) -> float:
    """:func:`flops_per_iteration` for a model section ``m`` (a ``trainer.config.model.ModelConfig``: the
    one place its architecture fields map onto the formula's arguments)."""
    return flops_per_iteration(batch, m.seq_length, m.num_layers, m.hidden_size, padded_vocab,
                               ffn_hidden_size=m.ffn_hidden_size, num_attention_heads=m.num_attention_heads,
                               num_query_groups=m.query_groups, kv_channels=m.head_dim,
                               swiglu=m.activation == "swiglu")


def layer_params(m) -> tuple[int, int]:
    """Parameters of one transformer layer of a model section ``m``: (split across tensor-parallel ranks,
    replicated on each). Split: the QKV (a·d query rows, 2·g·d key/value rows), attention output, MLP
    matrices ([gate; up] with SwiGLU) and their column-parallel biases; replicated: the norms (weight,
    and bias for LayerNorm) and the row-parallel biases (trainer.parallel.sharding's table)."""
    h, f, d = m.hidden_size, m.ffn_hidden_size, m.head_dim
    q, kv = m.num_attention_heads * d, 2 * m.query_groups * d
    up = f * (2 if m.activation == "swiglu" else 1)
    bias = m.add_bias_linear
    split = h * (q + kv) + q * h + h * up + f * h + ((q + kv + up) if bias else 0)
    norm = h * (1 if m.normalization == "rmsnorm" else 2)
    return split, 2 * norm + (2 * h if bias else 0)


def stage_params(m, padded_vocab: int, tp: int = 1, pp: int = 1, counts: list[int] | None = None
                 ) -> tuple[int, int]:
    """(parameters on the busiest pipeline stage's device, parameters of the whole model) for a model
    section ``m``, its padded vocabulary (for ``tp``) and the layout; ``counts``: the layers of each stage
    (PipelineSplit.stage_counts; None: num_layers / pp each). The first stage holds the word embeddings
    (split over TP) and any learned position table; the last the final norm and the head: the untied
    output layer, or with pp > 1 the tied embeddings' copy (Megatron's word_embeddings_for_head, not
    counted in the total)."""
    split, replicated = layer_params(m)
    h = m.hidden_size
    embed = padded_vocab * h
    positions = (m.max_position_embeddings or m.seq_length) * h if m.position_embedding == "learned" else 0
    final_norm = h * (1 if m.normalization == "rmsnorm" else 2)
    head = 0 if m.tie_word_embeddings else embed
    counts = counts or [m.num_layers // pp] * pp
    per_layer = split // tp + replicated
    total = m.num_layers * (split + replicated) + embed + positions + final_norm + head
    if pp == 1:
        return counts[0] * per_layer + (embed + head) // tp + positions + final_norm, total
    first = counts[0] * per_layer + embed // tp + positions
    last = counts[-1] * per_layer + embed // tp + final_norm  # the untied head, or the tied copy
    return max(first, last, max(counts[1:-1], default=0) * per_layer), total


@dataclass(frozen=True)
class ActivationProfile:
    """What one transformer layer keeps for backward, per micro-batch, in bytes:
    ``s·b·h·linear + a·s²·b·attention`` without recomputation, ``s·b·h·selective`` with selective
    recomputation (the attention scores, softmax and dropout are recomputed; SDPA's math backend also
    drops what it saves beyond q, k, v). ``replicated``: the part of ``linear`` that tensor parallelism
    without sequence parallelism does not split (the LayerNorm/dropout regions). ``source`` says where the
    numbers come from."""

    linear: float
    attention: float
    selective: float
    replicated: float
    source: str
    element: int = 2
    """Bytes per activation element: what full recomputation keeps per element of the layer's input."""
    sp_gathered: float = 4
    """Under sequence parallelism, bytes per s·b·h kept at the full sequence length: Slipway saves the
    all-gathered inputs of the QKV and first MLP matmuls (2 × 2 bytes) for their weight gradients, where
    Megatron all-gathers them again in backward. Unsplit, so ``sp_gathered·(1 − 1/t)`` more than 1/t."""
    glu: float = 3
    """A SwiGLU MLP keeps this many elements per s·b·f (f = ffn_hidden_size) where a GeLU MLP keeps 2:
    [gate; up] and SiLU(gate)·up (3, the fused kernel); eager SiLU keeps its input again (4)."""
    rmsnorm: float = 0
    """Elements per s·b·h an RMSNorm keeps beyond a LayerNorm's (the fused kernels: none; eager: its
    fp32 intermediates, 2)."""

    def for_architecture(self, m) -> ActivationProfile:
        """This profile (measured on GPT-2 layers: GeLU, f = 4h, LayerNorm, learned positions) for a model
        section ``m``: the MLP width (2 elements per s·b·f), SwiGLU (``glu``), rope (2 elements per s·b·h
        with multi-head attention) and RMSNorm (``rmsnorm``, in the replicated region). Bias-free linears
        change nothing measurable. tests/model/test_activation_memory.py measures each option alone and
        the Llama combination."""
        e, f = self.element, m.ffn_hidden_size / m.hidden_size
        mlp = ((self.glu if m.activation == "swiglu" else 2) * f - 2 * 4) * e
        # Measured: rope keeps the rotated q and k (2 elements) beside the QKV output under multi-head
        # attention; with grouped-query attention the expansion of K/V to the heads keeps the copies
        # instead, and rope adds nothing beyond its cos/sin tables.
        mha = m.query_groups == m.num_attention_heads
        rope = 2 * e if m.position_embedding == "rope" and mha else 0
        norm = self.rmsnorm * e if m.normalization == "rmsnorm" else 0
        if mlp == rope == norm == 0:
            return self
        extra = mlp + rope + norm
        return replace(self, linear=self.linear + extra, selective=self.selective + extra,
                       replicated=self.replicated + norm, source=f"{self.source}; for the architecture")


PAPER = ActivationProfile(34, 5, 34, 10, "Korthikanti et al. 2022, table 2 (Megatron's GPU kernels)",
                          sp_gathered=0)
"""The published figures, which assume Megatron's fused GPU kernels (1-byte dropout masks)."""

# Measured on CPU with bench/recompute.py (saved_tensors_hooks, tp=1; tp=2 with and without sequence
# parallelism for ``replicated``) and re-checked within 10 % by tests/model/test_activation_memory.py; in
# bytes, so the fp32 rows are about twice the 16-bit ones. They differ from the paper because CPU dropout
# keeps its mask in the activation dtype (not 1 byte), the csrc GeLU and bias-dropout-add kernels save
# less than Megatron's unfused ones, and SDPA's CPU math backend saves its own scores and output. On
# CUDA, SDPA's flash/efficient kernels keep only q, k, v, the output and the log-sum-exp, so the
# attention term vanishes without any recomputation (the paper's figures otherwise; unmeasured here).
_MEASURED = "measured, bench/results/recompute.json"
ACTIVATION_PROFILES: dict[tuple[str, str, str, int], ActivationProfile] = {
    ("cpu", "csrc", "softmax", 16): ActivationProfile(32, 6, 32, 8, _MEASURED),
    ("cpu", "csrc", "sdpa", 16): ActivationProfile(38, 12, 32, 8, _MEASURED),
    ("cpu", "eager", "softmax", 16): ActivationProfile(40, 8, 40, 10, _MEASURED, glu=4, rmsnorm=2),
    ("cpu", "eager", "sdpa", 16): ActivationProfile(46, 12, 40, 10, _MEASURED, glu=4, rmsnorm=2),
    ("cpu", "csrc", "softmax", 32): ActivationProfile(64, 12, 64, 16, _MEASURED, 4, 8),
    ("cpu", "csrc", "sdpa", 32): ActivationProfile(72, 12, 64, 16, _MEASURED, 4, 8),
    ("cpu", "eager", "softmax", 32): ActivationProfile(72, 12, 72, 20, _MEASURED, 4, 8, glu=4, rmsnorm=2),
    ("cpu", "eager", "sdpa", 32): ActivationProfile(80, 12, 72, 20, _MEASURED, 4, 8, glu=4, rmsnorm=2),
    ("cuda", "fused", "softmax", 16): PAPER,
    ("cuda", "fused", "sdpa", 16): ActivationProfile(34, 0, 34, 10, "the paper without the attention term "
                                                     "(flash/efficient SDPA on CUDA; unmeasured)",
                                                     sp_gathered=0),
    ("cuda", "fused", "softmax", 32): ActivationProfile(68, 10, 68, 20, "the paper at 4-byte activations",
                                                        4, 0),
    ("cuda", "fused", "sdpa", 32): ActivationProfile(68, 0, 68, 20, "the paper at 4-byte activations, "
                                                     "without the attention term (unmeasured)", 4, 0),
}


def activation_profile(device: str, kernels: str, attention_backend: str,
                       precision: str = "bf16") -> ActivationProfile:
    """The profile for a run: ``device`` cpu|cuda, the ``kernels`` key, ``model.attention_backend`` and
    ``train.precision``. On CPU ``auto`` means csrc (what `make install` builds) and ``compile`` is
    counted as eager (not measured: torch.compile may save less); on CUDA every kernel set uses the
    paper's figures (Megatron's kernels are the ones it measured)."""
    width = 32 if precision == "fp32" else 16
    if device == "cuda":
        return ACTIVATION_PROFILES[("cuda", "fused", attention_backend, width)]
    family = "eager" if kernels in ("eager", "compile") else "csrc"
    return ACTIVATION_PROFILES[("cpu", family, attention_backend, width)]


def activation_bytes_per_layer(seq: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none",
                               profile: ActivationProfile = PAPER) -> float:
    """Bytes one transformer layer keeps for backward per micro-batch (Korthikanti et al. 2022,
    table 2, with ``profile``'s coefficients; the paper's, for 16-bit activations, are
    ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` with tensor parallelism t, ``s·b·h·(34 + 5·a·s/h)/t`` with
    sequence parallelism too); selective recomputation keeps ``s·b·h·selective`` (split alike); full
    keeps only the layer's input, ``2·s·b·h`` in 16 bits (``/t`` with sequence parallelism)."""
    sbh = seq * micro_batch * hidden
    if recompute == "full":
        return profile.element * sbh / (tp if sequence_parallel else 1)
    linear = profile.selective if recompute == "selective" else profile.linear
    attention = 0.0 if recompute == "selective" else profile.attention * heads * seq / hidden
    if sequence_parallel:
        return sbh * ((linear + attention) / tp + profile.sp_gathered * (1 - 1 / tp))
    return sbh * (profile.replicated + (linear - profile.replicated) / tp + attention / tp)


def stage_activation_bytes(layers: int, seq: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                           sequence_parallel: bool = False, granularity: str = "none",
                           method: str = "uniform", recompute_layers: int = 1,
                           profile: ActivationProfile = PAPER) -> float:
    """One pipeline stage's ``layers`` for one micro-batch, by Megatron's recompute methods: full
    ``uniform`` keeps the input of each group of ``recompute_layers`` layers, ``block`` recomputes the
    first ``recompute_layers`` layers and stores the rest in full. (The layers being recomputed during
    backward need one layer group's full activations transiently; not counted, as in the paper.)"""
    def per(kind: str) -> float:
        return activation_bytes_per_layer(seq, micro_batch, hidden, heads, tp, sequence_parallel, kind,
                                          profile)

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


def recompute_time_factor(granularity: str, seq: int, hidden: int, layers: int = 1, method: str = "uniform",
                          recompute_layers: int = 1) -> float:
    """How much longer a step takes with recomputation, by FLOPs (a compute-bound GPU): a recomputed
    layer runs its forward twice, and the forward is 1/3 of forward + backward (Megatron counts full
    recomputation as 4/3 of the model FLOPs). Selective recomputes only the core attention, ``4·b·s²·h``
    of the layer's ``24·b·s·h² + 4·b·s²·h`` forward FLOPs. On CPU, where the recomputed softmax and
    dropout are memory-bound, bench/recompute.py measures more (1.4–1.8× per layer)."""
    if granularity == "selective":
        return 1 + seq / (6 * hidden + seq) / 3
    if granularity == "full":
        share = 1.0 if method == "uniform" else min(recompute_layers, layers) / max(layers, 1)
        return 1 + share / 3
    return 1.0


# The bytes each rank moves per byte of the buffer, as nccl-tests defines bus bandwidth (its
# doc/PERFORMANCE.md): a ring all-reduce sends 2(n − 1)/n, a reduce-scatter or all-gather (n − 1)/n.
COLLECTIVE_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
                     "all_gather": lambda n: (n - 1) / n}


def collective_seconds(kind: str, nbytes: float, ranks: int, bus_gbps: float) -> float:
    """Time of one collective over ``ranks`` ranks on a ``nbytes`` buffer at a bus bandwidth of ``bus_gbps``
    GB/s (what nccl-tests prints as busbw): ``nbytes · factor(n) / busbw``; 0 for one rank."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return nbytes * COLLECTIVE_FACTOR[kind](ranks) / (bus_gbps * 1e9)


def tensor_parallel_seconds(layers: float, micro_batch: int, seq: int, hidden: int, tp: int,
                            element_bytes: int, bus_gbps: float, recomputed_layers: float = 0) -> float:
    """The tensor-parallel communication of one micro-batch through ``layers`` transformer layers, which
    nothing overlaps (each all-reduce sits between two matrix products): Megatron's split needs "only two
    all-reduce operations in the forward pass and two in the backward pass" per layer (Shoeybi et al. 2019,
    §3 and fig. 4), each over the ``b·s·h`` activations in the compute dtype (``element_bytes``), a ring
    all-reduce costing ``2(t − 1)/t · bytes / busbw`` (:func:`collective_seconds`) — Narayanan et al. 2021,
    §3.3.1: ``8·b·s·h·(t − 1)/t`` per layer, device and micro-batch. Sequence parallelism swaps each
    all-reduce for an all-gather plus a reduce-scatter of the same bytes (Korthikanti et al. 2022, §4.2.2):
    the same time. A layer recomputed in full runs its forward, and its two all-reduces, again
    (``recomputed_layers``); selective recomputation recomputes no communication."""
    one = collective_seconds("all_reduce", micro_batch * seq * hidden * element_bytes, tp, bus_gbps)
    return (4 * layers + 2 * recomputed_layers) * one


def pipeline_p2p_seconds(num_microbatches: int, micro_batch: int, seq: int, hidden: int,
                         element_bytes: int, gbps: float) -> float:
    """The pipeline's point-to-point traffic of one step on the slowest link between two stages: each
    micro-batch's activations forward and their gradient back, ``b·s·h`` elements each way (Narayanan et al.
    2021, §3.3.1: "the total amount of communication ... between every pair of consecutive devices (for
    either the forward or backward pass) for each microbatch is bsh"), waited for in 1F1B's steady state."""
    return 2 * num_microbatches * micro_batch * seq * hidden * element_bytes / (gbps * 1e9)


@dataclass(frozen=True)
class PipelineSplit:
    """How ``num_layers`` transformer layers split over ``pp_size`` pipeline stages and ``virtual_pp_size``
    model chunks per stage: Megatron's rule (megatron/core/transformer/transformer_block.py
    get_num_layers_to_build, transformer_layer.py get_transformer_layer_offset), the one definition the
    trainer, its checkpoints, the converters and the plan all read.

    Evenly by default: every stage holds num_layers / pp. Megatron's uneven split
    (``--decoder-first-pipeline-num-layers F``, ``--decoder-last-pipeline-num-layers L``; Slipway's
    parallel.first_stage_layers / last_stage_layers) gives the first (last) stage F (L) layers and the
    stages between the rest, evenly. With interleaving each stage's layers are cut into v equal chunks,
    and chunk c of stage r holds, from layer c·num_layers/v + Σ_{r' < r} count(r')/v, count(r)/v layers
    (the round-robin of Narayanan et al. 2021 §2.2.2 when the split is even). Checkpoints number the
    layers of each chunk from 0 (Megatron's convention).
    """

    num_layers: int
    pp_size: int = 1
    virtual_pp_size: int = 1
    first: int | None = None
    last: int | None = None

    @property
    def uneven(self) -> bool:
        return self.first is not None or self.last is not None

    def problem(self) -> str | None:
        """Why the layers cannot split so (a sentence naming the sizes), or None."""
        p, v, n = self.pp_size, self.virtual_pp_size, self.num_layers
        ends = [x for x in (self.first, self.last) if x is not None]
        if any(x < 1 for x in ends) or p < 1 or v < 1 or n < 1:
            return "every stage and chunk needs at least one layer"
        if self.uneven and p < 2:
            return f"an uneven split needs at least 2 pipeline stages (pp_size={p})"
        if len(ends) == 2 and p < 3 and self.first + self.last != n:
            return f"the first and last stage hold {self.first} + {self.last} layers, not num_layers={n}"
        middle, rest = p - len(ends), n - sum(ends)
        if rest < middle or (middle and rest % middle) or (not middle and rest):
            where = "the stages between" if ends else "the stages"
            return (f"num_layers={n} leaves {rest} layer(s) for {middle} of {where}, not an equal share each"
                    if ends else f"num_layers={n} is not divisible by pp_size={p}")
        counts = self._counts()
        if v > 1 and any(c % v for c in counts):
            return (f"a stage's {counts} layers do not split into virtual_pp_size={v} equal chunks"
                    if self.uneven else f"num_layers={n} is not divisible by pp_size·virtual_pp_size = "
                    f"{p}·{v} = {p * v} (each model chunk needs equal layers)")
        return None

    def _counts(self) -> list[int]:
        ends = [x for x in (self.first, self.last) if x is not None]
        middle = self.pp_size - len(ends)
        share = (self.num_layers - sum(ends)) // middle if middle else 0
        counts = [share] * self.pp_size
        if self.first is not None:
            counts[0] = self.first
        if self.last is not None:
            counts[-1] = self.last
        return counts

    def stage_counts(self) -> list[int]:
        """Layers on each stage (all its chunks); ValueError when :meth:`problem` says why not."""
        why = self.problem()
        if why:
            raise ValueError(why)
        return self._counts()

    def chunk_layers(self, pp_rank: int, chunk: int = 0) -> range:
        """The global layer numbers chunk ``chunk`` of stage ``pp_rank`` holds."""
        if not 0 <= chunk < self.virtual_pp_size or not 0 <= pp_rank < self.pp_size:
            raise ValueError(f"stage {pp_rank} chunk {chunk} is outside pp_size={self.pp_size}, "
                             f"virtual_pp_size={self.virtual_pp_size}")
        counts, v = self.stage_counts(), self.virtual_pp_size
        start = chunk * (self.num_layers // v) + sum(counts[:pp_rank]) // v
        return range(start, start + counts[pp_rank] // v)

    def locate(self, index: int) -> tuple[int, int, int]:
        """(stage, chunk, local layer number within the chunk) of global layer ``index``."""
        for r in range(self.pp_size):
            for c in range(self.virtual_pp_size):
                held = self.chunk_layers(r, c)
                if index in held:
                    return r, c, index - held.start
        raise ValueError(f"layer {index} is outside num_layers={self.num_layers}")
