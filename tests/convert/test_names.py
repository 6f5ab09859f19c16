"""The declarative name map, its derived inverse, and TP/PP merge and split (no transformers model run)."""

from __future__ import annotations

import torch

from tests.convert.conftest import random_megatron_state, tiny_spec
from trainer.convert import names
from trainer.convert.shard_io import flatten, nest
from trainer.convert.shards import load_merged, split, write_checkpoint


def test_every_gpt2_parameter_has_a_rule():
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=100, n_positions=16))
    hf_names = {k for k in model.state_dict() if k != "lm_head.weight"}
    spec = tiny_spec(layers=3)
    mapped = {r.hf.format(i=i) for r in names.RULES if r.hf  # the untied head has no GPT-2 name
              for i in (range(3) if r.stage == names.LAYER else [None])}
    assert mapped == hf_names
    assert len(names.expected_megatron_names(3)) == len(hf_names)
    assert spec.num_layers == 3


def test_inverse_is_exact_and_qkv_order_is_per_head():
    spec = tiny_spec(layers=2)
    state = random_megatron_state(spec)
    hf = names.megatron_to_hf(state, spec.shapes)
    back = names.hf_to_megatron(hf, spec.shapes)
    assert back.keys() == state.keys()
    for k, v in state.items():
        expect = v if k != names.WORD_EMBEDDINGS else torch.cat([v[: spec.vocab_size],
                                                                   torch.zeros_like(v[spec.vocab_size:])])
        assert torch.equal(back[k], expect), k
    # Megatron rows are [head, (q,k,v), d]; HF columns are [Q all heads | K | V].
    h, heads = spec.hidden_size, spec.num_attention_heads
    d = h // heads
    qkv = state["language_model.encoder.layers.1.self_attention.query_key_value.weight"]
    c_attn = hf["transformer.h.1.attn.c_attn.weight"]
    assert c_attn.shape == (h, 3 * h)
    for head in range(heads):
        for j in range(3):
            assert torch.equal(c_attn[:, j * h + head * d: j * h + (head + 1) * d].t(),
                               qkv[(head * 3 + j) * d: (head * 3 + j + 1) * d])
    assert hf["transformer.wte.weight"].shape[0] == spec.vocab_size  # padding rows dropped


def test_checkpoint_version_1_qkv_layout():
    spec = tiny_spec(layers=1)
    shapes_v1 = names.Shapes(spec.num_attention_heads, spec.vocab_size, spec.padded_vocab_size, 1.0)
    hf_order = torch.arange(3 * spec.hidden_size, dtype=torch.float32)  # [3, heads, d] flattened
    d = spec.hidden_size // spec.num_attention_heads
    v1 = hf_order.view(3, spec.num_attention_heads, d).permute(1, 2, 0).reshape(-1)  # [heads, d, 3]
    assert torch.equal(names.TRANSFORMS["qkv_bias"][0](v1, shapes_v1), hf_order)


def test_nest_matches_megatron_layout_and_flattens_back():
    spec = tiny_spec(layers=2)
    state = random_megatron_state(spec)
    tree = nest(state)
    assert tree["language_model"]["embedding"]["word_embeddings"]["weight"] is state[names.WORD_EMBEDDINGS]
    assert "layers.1.mlp.dense_4h_to_h.bias" in tree["language_model"]["encoder"]
    assert "final_layernorm.weight" in tree["language_model"]["encoder"]
    assert flatten(tree).keys() == state.keys()


def test_split_uses_local_layer_numbers_and_head_copy(tmp_path):
    spec = tiny_spec(tp=2, layers=4)
    state = random_megatron_state(spec)
    shards = split(state, 2, 2)
    last = shards[(1, 1)]
    assert names.HEAD_EMBEDDINGS in last and names.WORD_EMBEDDINGS not in last
    assert "language_model.encoder.layers.0.input_layernorm.weight" in last  # global layer 2, local 0
    assert "language_model.encoder.layers.2.input_layernorm.weight" not in last
    qkv = "language_model.encoder.layers.0.self_attention.query_key_value.weight"
    assert shards[(0, 0)][qkv].shape == (3 * spec.hidden_size // 2, spec.hidden_size)
    dense = "language_model.encoder.layers.0.self_attention.dense.weight"
    assert shards[(1, 0)][dense].shape == (spec.hidden_size, spec.hidden_size // 2)


def test_merge_accepts_global_layer_numbers(tmp_path):
    """Checkpoints whose stages use global layer indices merge to the same state as Megatron's local ones."""
    spec = tiny_spec(layers=4)
    state = random_megatron_state(spec)
    local_dir = write_checkpoint(tmp_path / "local", state, {"num_attention_heads": 4}, 5, (1, 2))
    merged_local = load_merged(local_dir, 5)
    # Rewrite stage 1 with global indices 2, 3.
    path = local_dir / "mp_rank_00_001" / "model_optim_rng.pt"
    shard = torch.load(path, weights_only=True)
    lm = shard["model"]["language_model"]
    renumber = {"layers.0.": "layers.2.", "layers.1.": "layers.3."}
    lm["encoder"] = {renumber.get(k[:9], k[:9]) + k[9:]: v for k, v in lm["encoder"].items()}
    torch.save(shard, path)
    merged_global = load_merged(local_dir, 5)
    assert merged_global.state.keys() == merged_local.state.keys() == state.keys()
    for k in state:
        assert torch.equal(merged_global.state[k], state[k]) and torch.equal(merged_local.state[k], state[k])
