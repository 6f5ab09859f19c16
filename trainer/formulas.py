"""Torch-free formulas the trainer and the orchestrator share (one definition each): the rendezvous port,
the batch rules, the vocabulary, Megatron's FLOPs, the parameters per layer and stage, and the pipeline's
split of the layers. By subject beside it: trainer/memory_formulas.py (activations, state bytes per
parameter) and trainer/time_formulas.py (bubble, recomputation, collectives)."""

from __future__ import annotations

from dataclasses import dataclass

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
