"""The one sharding table (trainer/parallel/sharding.py) is what the TP plan, reshard and the converters
use: every GPT parameter has exactly one row, the modules the plan builds split where the table says,
and the converters' rules read their kind from it."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from trainer.config.model import ModelConfig
from trainer.convert import names as convert_names
from trainer.model.gpt import GPT, StageSpec
from trainer.model.names import layer_index, renumber
from trainer.parallel import sharding
from trainer.parallel.apply import apply_tensor_parallel, sequence_parallel_param_names, tp_partition_dims
from trainer.parallel.random import RNGTracker
from trainer.parallel.state import Group
from trainer.restore import reshard

CFG = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100)


# The Llama options: GQA, SwiGLU (the GLU split), RMSNorm, no biases, an untied head (output_layer).
LLAMA = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=16,
                  vocab_size=100, position_embedding="rope", normalization="rmsnorm", activation="swiglu",
                  add_bias_linear=False, tie_word_embeddings=False)


def _stage(first: bool, last: bool, tp: int, cfg: ModelConfig = CFG) -> GPT:
    """One pipeline stage (layers 2-3 when it is not the first), TP-planned for ``tp`` ranks on meta."""
    stage = StageSpec(0 if first else 2, 2 if not last else 4, pre_process=first, post_process=last)
    with torch.device("meta"):
        model = GPT(cfg, stage, padded_vocab_size=cfg.padded_vocab_size(tp), kernels="eager")
        if tp > 1:
            pstate = SimpleNamespace(tp_size=tp, tp_group=Group(tuple(range(tp))))
            apply_tensor_parallel(model, pstate, sequence_parallel=True, tracker=RNGTracker())
    return model


def _table_names(num_layers: int) -> set[str]:
    layers = {f"encoder.layers.{i}.{rest}" for i in range(num_layers) for rest in sharding.LAYER_PARAMS}
    return layers | set(sharding.MODEL_PARAMS)


def test_every_parameter_has_exactly_one_row_and_no_row_is_stale():
    whole = {n for n, _ in _stage(True, True, 1).named_parameters()}
    last = {n for n, _ in _stage(False, True, 1).named_parameters()}  # holds word_embeddings_for_head
    seen = whole | {n for n in last if layer_index(n) is None}
    llama = {n for n, _ in _stage(True, True, 1, LLAMA).named_parameters()}  # + output_layer
    assert llama <= _table_names(CFG.num_layers) and "output_layer.weight" in llama
    assert seen | llama == _table_names(CFG.num_layers)


@pytest.mark.parametrize("first,last", [(True, False), (False, True)])
def test_the_tp_plan_splits_each_parameter_where_the_table_says(first, last):
    model = _stage(first, last, tp=2)
    dims = tp_partition_dims(model)
    assert dims and all(dims[n] == sharding.tp_dim(n) for n in dims), \
        {n: (d, sharding.tp_dim(n)) for n, d in dims.items() if d != sharding.tp_dim(n)}
    for name, p in model.named_parameters():  # the shard really is half the full tensor on that dim
        dim = sharding.tp_dim(name)
        if dim is not None:
            owner, leaf = name.rpartition(".")[::2]
            assert model.get_submodule(owner).full_shape(leaf)[dim] == 2 * p.shape[dim], name


def test_sequence_parallel_sync_covers_the_layernorms_and_row_biases_only():
    names = sequence_parallel_param_names(_stage(True, True, tp=2))
    assert names and all("layernorm" in n or n.endswith(("dense.bias", "dense_4h_to_h.bias")) for n in names)
    assert "encoder.layers.0.mlp.dense_h_to_4h.bias" not in names  # column bias: sharded, not synced
    assert "encoder.final_layernorm.weight" in names


def test_converter_rules_read_their_kind_from_the_table():
    for rule in convert_names.RULES:
        flat = rule.megatron.replace("{i}", "3")
        assert rule.tp == sharding.kind(flat) == sharding.kind(flat.removeprefix("language_model."))
    assert sharding.kind(convert_names.HEAD_EMBEDDINGS) == sharding.VOCAB
    with pytest.raises(KeyError, match="sharding table"):
        sharding.kind("encoder.layers.0.mlp.gate.weight")


def test_layer_numbers_and_stages():
    name = "language_model.encoder.layers.7.mlp.dense_h_to_4h.weight"
    assert layer_index(name) == 7 and layer_index("embedding.word_embeddings.weight") is None
    assert renumber(name, -4) == "language_model.encoder.layers.3.mlp.dense_h_to_4h.weight"
    assert renumber("encoder.layers.11.input_layernorm.bias", 1) == "encoder.layers.12.input_layernorm.bias"
    assert [sharding.stage_of_layer(i, 12, 3) for i in (0, 3, 4, 11)] == [(0, 0), (0, 3), (1, 0), (2, 3)]
    assert list(sharding.stage_layers(12, 3, 1)) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="num_layers=12 is not divisible by pp_size=5"):
        sharding.stage_layers(12, 5, 0)


@pytest.mark.parametrize("layers,pp,v,first,last,held", [
    (3, 2, 1, 1, None, [[[0]], [[1, 2]]]),                      # --decoder-first-pipeline-num-layers 1
    (3, 2, 1, None, 1, [[[0, 1]], [[2]]]),                      # --decoder-last-pipeline-num-layers 1
    (7, 3, 1, 1, 2, [[[0]], [[1, 2, 3, 4]], [[5, 6]]]),         # both; the middle stage takes the rest
    (10, 3, 2, 2, 4, [[[0], [5]], [[1, 2], [6, 7]], [[3, 4], [8, 9]]]),  # interleaved: per chunk c,
])                                                              # c·L/v + Σ earlier stages' count / v
def test_megatrons_uneven_split(layers, pp, v, first, last, held):
    """Megatron's get_num_layers_to_build / get_transformer_layer_offset (core_v0.19.0) by hand."""
    got = [[list(sharding.stage_layers(layers, pp, r, v, c, first, last)) for c in range(v)]
           for r in range(pp)]
    assert got == held
    for i in range(layers):
        r, c, local = sharding.chunk_of_layer(i, layers, pp, v, first, last)
        assert held[r][c][local] == i


@pytest.mark.parametrize("layers,pp,v,first,last,why", [
    (4, 1, 1, 1, None, "needs at least 2 pipeline stages"),
    (4, 3, 1, 1, None, "leaves 3 layer"),
    (4, 2, 1, 1, 2, "1 + 2 layers, not num_layers=4"),
    (5, 2, 2, 1, None, "do not split into virtual_pp_size=2"),
    (4, 2, 1, 0, None, "at least one layer"),
])
def test_splits_that_cannot_be_are_refused_with_the_sizes(layers, pp, v, first, last, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        sharding.stage_layers(layers, pp, 0, v, 0, first, last)


def test_reshard_slices_the_last_stages_head_copy_like_the_embedding():
    """The head copy is vocab-parallel too (the old suffix list missed it and kept it whole)."""
    full = torch.arange(130 * 2, dtype=torch.float32).reshape(130, 2)
    target = reshard.Target(tp_rank=1, tp_size=2, layer_start=2, layer_end=4, pre_process=False,
                            post_process=True, padded_vocab_size=256)
    got = reshard.target_slice(full, "word_embeddings_for_head.weight", target)
    assert got.shape == (128, 2) and torch.equal(got[:2], full[128:130]) and not got[2:].any()


def test_glu_split_gives_each_rank_matching_gate_and_up_halves():
    """SwiGLU's [gate; up] rows: rank r holds [gate_r; up_r] (Megatron's per-rank layout), not rows r."""
    full = torch.arange(8 * 2).reshape(8, 2)  # gate rows 0-3, up rows 4-7
    parts = sharding.split_tp(full, sharding.GLU, 2)
    assert [p[:, 0].div(2).tolist() for p in parts] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert torch.equal(sharding.merge_tp(parts, sharding.GLU), full)
    assert torch.equal(sharding.merge_tp(sharding.split_tp(full, sharding.COLUMN, 2), sharding.COLUMN), full)
    name = "encoder.layers.1.mlp.dense_h_to_4h.weight"
    assert sharding.kind(name) == sharding.COLUMN and sharding.kind(name, swiglu=True) == sharding.GLU
    assert sharding.kind("encoder.layers.1.mlp.dense_4h_to_h.weight", swiglu=True) == sharding.ROW
    with pytest.raises(ValueError, match="does not split into tp=3"):
        sharding.split_tp(full, sharding.GLU, 3)


def test_the_llama_tp_plan_splits_groups_glu_halves_and_the_untied_head():
    model = _stage(True, True, tp=2, cfg=LLAMA)
    layer = model.encoder.layers[0]
    d, ffn = LLAMA.head_dim, LLAMA.ffn_hidden_size
    # [ng, np/ng + 2, d] rows split by whole KV groups: one group (2 q heads, k, v) per rank.
    assert layer.self_attention.query_key_value.weight.shape == (4 * d, 32)
    assert layer.mlp.dense_h_to_4h.weight.shape == (ffn, 32) and layer.mlp.dense_h_to_4h.glu
    assert layer.mlp.dense_h_to_4h.bias is None and layer.self_attention.dense.bias is None
    assert model.output_layer.weight.shape == (LLAMA.padded_vocab_size(2) // 2, 32)
    assert tp_partition_dims(model)["output_layer.weight"] == 0
    assert not hasattr(model, "word_embeddings_for_head")
