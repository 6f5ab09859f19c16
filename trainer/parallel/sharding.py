"""The one table of how the GPT is split: each parameter's tensor-parallel kind and each layer's stage.

Every user reads this table instead of spelling the rules again: the TP plan (``parallel.apply`` picks
Column/Row/Vocab-parallel modules by it; the modules' split dims come from :data:`DIM`), reshard-on-load
(``trainer.checkpoint.reshard``), the converters' merge and split (``trainer.convert.names`` derives
each rule's ``tp`` from it), and the sequence-parallel gradient sync (replicated parameters of the
sharded region).

Megatron's split of a transformer layer (``formats.md`` §4):

| kind        | parameters                                                   | split                 |
|-------------|--------------------------------------------------------------|-----------------------|
| column      | query_key_value weight+bias, dense_h_to_4h weight+bias       | dim 0 (output rows)   |
| row         | self_attention.dense and dense_4h_to_h weights               | dim 1 (input columns) |
| vocab       | word embeddings (and the last stage's head copy)             | dim 0 (vocab rows)    |
| replicated  | LayerNorms, position embeddings, row-parallel biases         | —                     |

Names are the GPT's flat names (``encoder.layers.{i}.…``); Megatron's checkpoint names (a
``language_model.`` prefix) are accepted too. Pipeline stages hold contiguous, equal blocks of layers and
number them from 0 in checkpoints (Megatron's convention); :func:`stage_of_layer` is that rule
(``trainer.model.names.renumber`` turns local numbers into global ones).
"""

from __future__ import annotations

from trainer.model.names import LAYER_RE

COLUMN, ROW, REPLICATED, VOCAB = "column", "row", "replicated", "vocab"
DIM: dict[str, int | None] = {COLUMN: 0, ROW: 1, VOCAB: 0, REPLICATED: None}

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
}

_MEGATRON_PREFIX = "language_model."


def kind(name: str) -> str:
    """A parameter's tensor-parallel kind: COLUMN, ROW, VOCAB or REPLICATED."""
    flat = name.removeprefix(_MEGATRON_PREFIX)
    m = LAYER_RE.search(flat)
    found = LAYER_PARAMS.get(flat[m.end():]) if m else MODEL_PARAMS.get(flat)
    if found is None:
        raise KeyError(f"{name!r} is not a GPT parameter in the sharding table "
                       "(trainer/parallel/sharding.py); a new parameter needs a row there")
    return found


def tp_dim(name: str) -> int | None:
    """The dim a parameter is split on across tensor-parallel ranks (None: replicated)."""
    return DIM[kind(name)]


def layers_per_stage(num_layers: int, pp_size: int) -> int:
    if num_layers % pp_size:
        raise ValueError(f"num_layers={num_layers} does not divide by pp_size={pp_size}; choose a "
                         "pipeline size that divides the number of layers")
    return num_layers // pp_size


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The global layer numbers pipeline stage ``pp_rank`` holds."""
    per = layers_per_stage(num_layers, pp_size)
    return range(pp_rank * per, (pp_rank + 1) * per)


def stage_of_layer(index: int, num_layers: int, pp_size: int) -> tuple[int, int]:
    """(stage, local layer number) of global layer ``index``."""
    per = layers_per_stage(num_layers, pp_size)
    return index // per, index % per
