"""The one table of how the GPT is split: each parameter's tensor-parallel kind and each layer's stage.

Every user reads this table instead of spelling the rules again: the TP plan (``parallel.apply`` picks
Column/Row/Vocab-parallel modules by it; the modules' split dims come from :data:`DIM`), reshard-on-load
(``trainer.restore.reshard``), the converters' merge and split (``trainer.convert.names`` derives
each rule's ``tp`` from it), and the sequence-parallel gradient sync (replicated parameters of the
sharded region).

Megatron's split of a transformer layer (``formats.md`` §4):

| kind        | parameters                                                   | split                 |
|-------------|--------------------------------------------------------------|-----------------------|
| column      | query_key_value weight+bias, dense_h_to_4h weight+bias       | dim 0 (output rows)   |
| row         | self_attention.dense and dense_4h_to_h weights               | dim 1 (input columns) |
| vocab       | word embeddings (and the last stage's head copy)             | dim 0 (vocab rows)    |
| replicated  | LayerNorms, position embeddings, row-parallel biases         | —                     |
| glu         | dense_h_to_4h weight+bias of a SwiGLU MLP ([gate; up] rows)  | each half on dim 0    |

A SwiGLU MLP's first matrix is [gate; up]; Megatron gives TP rank r the rows [gate_r; up_r] (so the
rank's SiLU(gate)·up needs no communication), which is not a plain row split of the full tensor:
:func:`split_tp` and :func:`merge_tp` are the one definition of every kind's split, GLU included. The
name alone cannot tell a GeLU h→4h from a SwiGLU one, so :func:`kind` takes ``swiglu`` (the model's
``activation == "swiglu"``; Megatron's ``args.swiglu``). Grouped-query QKV needs no kind of its own: its
rows are grouped per KV group (``trainer.model.gpt``), so a row split hands each rank whole groups.

Names are the GPT's flat names (``encoder.layers.{i}.…``); Megatron's checkpoint names (a
``language_model.`` prefix) are accepted too. Pipeline stages hold blocks of layers — equal ones, or
with Megatron's uneven split a different number on the first and/or last stage; one contiguous block, or
with interleaving (virtual pipeline stages) v chunks dealt round-robin — and number them from 0 within
each block in checkpoints (Megatron's convention); :func:`stage_layers` and its inverse
:func:`chunk_of_layer` are that rule (``trainer.formulas.PipelineSplit``;
``trainer.model.names.renumber`` turns local numbers into global ones).
"""

from __future__ import annotations

import torch

from trainer.formulas import PipelineSplit
from trainer.model.names import LAYER_RE

COLUMN, ROW, REPLICATED, VOCAB, GLU = "column", "row", "replicated", "vocab", "glu"
DIM: dict[str, int | None] = {COLUMN: 0, ROW: 1, VOCAB: 0, REPLICATED: None, GLU: 0}

# Inside encoder.layers.{i}.
LAYER_PARAMS: dict[str, str] = {
    "input_layernorm.weight": REPLICATED,
    "input_layernorm.bias": REPLICATED,
    "self_attention.query_key_value.weight": COLUMN,
    "self_attention.query_key_value.bias": COLUMN,
    "self_attention.dense.weight": ROW,
    "self_attention.dense.bias": REPLICATED,  # added after the all-reduce: every rank holds it
    "post_attention_layernorm.weight": REPLICATED,
    "post_attention_layernorm.bias": REPLICATED,
    "mlp.dense_h_to_4h.weight": COLUMN,
    "mlp.dense_h_to_4h.bias": COLUMN,
    "mlp.dense_4h_to_h.weight": ROW,
    "mlp.dense_4h_to_h.bias": REPLICATED,
}
# Outside the layers.
MODEL_PARAMS: dict[str, str] = {
    "embedding.word_embeddings.weight": VOCAB,
    "embedding.position_embeddings.weight": REPLICATED,
    "encoder.final_layernorm.weight": REPLICATED,
    "encoder.final_layernorm.bias": REPLICATED,
    "word_embeddings_for_head.weight": VOCAB,  # the tied head's copy on a last stage without the embedding
    "output_layer.weight": VOCAB,  # the untied head (Llama; Megatron's --untie-embeddings-and-output-weights)
}
_GLU_PARAMS = ("mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias")

_MEGATRON_PREFIX = "language_model."


def kind(name: str, swiglu: bool = False) -> str:
    """A parameter's tensor-parallel kind: COLUMN, ROW, VOCAB, REPLICATED, or GLU (``swiglu`` models)."""
    flat = name.removeprefix(_MEGATRON_PREFIX)
    m = LAYER_RE.search(flat)
    found = LAYER_PARAMS.get(flat[m.end():]) if m else MODEL_PARAMS.get(flat)
    if found is None:
        raise KeyError(f"{name!r} is not a GPT parameter in the sharding table "
                       "(trainer/parallel/sharding.py); a new parameter needs a row there")
    return GLU if swiglu and m and flat[m.end():] in _GLU_PARAMS else found


def tp_dim(name: str) -> int | None:
    """The dim a parameter is split on across tensor-parallel ranks (None: replicated)."""
    return DIM[kind(name)]


def split_tp(full: torch.Tensor, kind_: str, tp_size: int) -> list[torch.Tensor]:
    """The ``tp_size`` shards of a full tensor (views; replicated: the full tensor for every rank)."""
    dim = DIM[kind_]
    if dim is None or tp_size == 1 or full.dim() == 0:
        return [full] * tp_size
    if full.shape[dim] % (2 * tp_size if kind_ == GLU else tp_size):
        raise ValueError(f"a {kind_} tensor of shape {tuple(full.shape)} does not split into tp={tp_size} "
                         f"equal parts on dim {dim}; choose a tp_size that divides it")
    if kind_ == GLU:  # rank r: [gate_r; up_r]
        gate, up = full.chunk(2, dim=0)
        return [torch.cat(pair) for pair in zip(gate.chunk(tp_size), up.chunk(tp_size), strict=True)]
    return list(torch.chunk(full, tp_size, dim=dim))


def merge_tp(parts: list[torch.Tensor], kind_: str) -> torch.Tensor:
    """The full tensor from the TP ranks' shards in rank order (the inverse of :func:`split_tp`)."""
    dim = DIM[kind_]
    if dim is None or len(parts) == 1 or parts[0].dim() == 0:
        return parts[0]
    if kind_ == GLU:
        halves = [p.chunk(2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(parts, dim=dim)


def layers_per_stage(num_layers: int, pp_size: int, virtual_pp_size: int = 1) -> int:
    """Layers in one model chunk of an even split: num_layers / (pp_size · virtual_pp_size)."""
    counts = split_of(num_layers, pp_size, virtual_pp_size).stage_counts()
    return counts[0] // virtual_pp_size


def split_of(num_layers: int, pp_size: int, virtual_pp_size: int = 1, first: int | None = None,
             last: int | None = None) -> PipelineSplit:
    """The split (trainer.formulas.PipelineSplit), checked: a ValueError naming the sizes if it cannot be."""
    split = PipelineSplit(num_layers, pp_size, virtual_pp_size, first, last)
    why = split.problem()
    if why:
        raise ValueError(f"{why}; choose sizes that split the layers (parallel.pp_size, virtual_pp_size, "
                         "first_stage_layers, last_stage_layers)")
    return split


def stage_layers(num_layers: int, pp_size: int, pp_rank: int, virtual_pp_size: int = 1, chunk: int = 0,
                 first: int | None = None, last: int | None = None) -> range:
    """The global layer numbers model chunk ``chunk`` of pipeline stage ``pp_rank`` holds
    (:meth:`trainer.formulas.PipelineSplit.chunk_layers`: Megatron's even or uneven split, interleaved
    round-robin: with an even split chunk c of rank r holds chunk number c·p + r of L/(p·v) layers)."""
    return split_of(num_layers, pp_size, virtual_pp_size, first, last).chunk_layers(pp_rank, chunk)


def chunk_of_layer(index: int, num_layers: int, pp_size: int, virtual_pp_size: int = 1,
                   first: int | None = None, last: int | None = None) -> tuple[int, int, int]:
    """(stage, chunk, local layer number within the chunk) of global layer ``index``: the inverse of
    :func:`stage_layers` (Megatron numbers layers from 0 within each chunk in checkpoints)."""
    return split_of(num_layers, pp_size, virtual_pp_size, first, last).locate(index)


def stage_of_layer(index: int, num_layers: int, pp_size: int, first: int | None = None,
                   last: int | None = None) -> tuple[int, int]:
    """(stage, local layer number) of global layer ``index`` without interleaving."""
    stage, _, local = chunk_of_layer(index, num_layers, pp_size, 1, first, last)
    return stage, local
