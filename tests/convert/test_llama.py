"""LlamaForCausalLM ↔ Slipway at any (tp, pp), and Megatron-core names for Llama-style checkpoints (issue 16).

The HF models are real ``transformers`` Llamas built locally from a LlamaConfig (no hub): grouped-query
attention, an untied head and rope_theta ≠ 10000, random weights with a large init so greedy decoding is
meaningful, random RMSNorm weights so a swapped norm shows.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.convert.conftest import VOCAB
from trainer.checkpoint.files import arg
from trainer.convert.from_hf import FromHFConfig, convert_hf_model
from trainer.convert.hf_io import load_weights
from trainer.convert.mcore import gpt_flat, to_mcore_model
from trainer.convert.shard_io import CheckpointError, load_shard, save_shard
from trainer.convert.shards import load_merged
from trainer.convert.to_hf import ToHFConfig, convert_checkpoint


def _random_llama(tmp_path, tokenizer_dir, name="llama", **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    kwargs = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 96,
              "rope_theta": 250000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "initializer_range": 0.2, "bos_token_id": 0, "eos_token_id": 0, **overrides}
    model = LlamaForCausalLM(LlamaConfig(**kwargs)).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    out = tmp_path / name
    model.save_pretrained(out)
    for f in ("vocab.json", "merges.txt"):
        shutil.copyfile(tokenizer_dir / f, out / f)
    return model, out


def _logits(model_dir, x):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()(x).logits


def test_random_hf_llama_to_slipway_tp2_pp2_and_back_is_identical(tmp_path, tokenizer_dir):
    model, src = _random_llama(tmp_path, tokenizer_dir)
    report = convert_hf_model(FromHFConfig(src, tmp_path / "ckpt", tp_size=2, pp_size=2))
    assert report.passed and report.max_abs_logit_diff <= 1e-4, report.summary()
    shard = load_shard(tmp_path / "ckpt" / "iter_0000000" / "mp_rank_01_001" / "model_optim_rng.pt")
    args = shard["args"]
    assert args.swiglu and args.normalization == "RMSNorm" and args.position_embedding_type == "rope"
    assert args.num_query_groups == 2 and args.group_query_attention and args.rotary_base == 250000.0
    assert args.untie_embeddings_and_output_weights and not args.add_bias_linear
    assert "output_layer" in shard["model"]["language_model"]  # the untied head, on the last stage
    result = convert_checkpoint(ToHFConfig(tmp_path / "ckpt", tmp_path / "back"))
    assert result.report.passed and result.report.greedy_identical
    before, after = load_weights(src), load_weights(tmp_path / "back")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)  # HF → Slipway tp2 pp2 → HF is exact
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    assert config["rope_theta"] == 250000.0 and config["rms_norm_eps"] == 1e-6
    assert config["tie_word_embeddings"] is False and config["hidden_act"] == "silu"
    x = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(x).logits, _logits(tmp_path / "back", x))
    card = (tmp_path / "back" / "README.md").read_text()
    assert "# Llama model" in card and "verification PASSED" in card and "tags: [llama," in card
    n_params = sum(p.numel() for p in model.parameters())
    assert f"({n_params / 1e6:.1f}M parameters)" in card


def test_tied_llama_with_biases_and_mqa_round_trips(tmp_path, tokenizer_dir):
    """The other switches: a tied head (its copy on the last stage under pp), attention/MLP biases, MQA."""
    model, src = _random_llama(tmp_path, tokenizer_dir, tie_word_embeddings=True, attention_bias=True,
                               mlp_bias=True, num_key_value_heads=1)
    assert convert_hf_model(FromHFConfig(src, tmp_path / "ckpt", tp_size=1, pp_size=2)).passed
    merged = load_merged(tmp_path / "ckpt" / "iter_0000000", 0)
    assert "language_model.output_layer.weight" not in merged.state
    assert "language_model.encoder.layers.3.self_attention.query_key_value.bias" in merged.state
    assert convert_checkpoint(ToHFConfig(tmp_path / "ckpt", tmp_path / "back")).report.passed
    x = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(x).logits, _logits(tmp_path / "back", x))


def test_megatron_core_names_of_a_llama_checkpoint_convert(tmp_path, tokenizer_dir):
    """A Megatron-core (--use-mcore-models --swiglu --normalization RMSNorm --position-embedding-type rope
    --group-query-attention --untie-embeddings-and-output-weights) shard layout: decoder.layers.*,
    linear_qkv/linear_fc1 fused, output_layer the untied head. Written from a converted checkpoint with
    the mcore map, then read back by to_hf."""
    model, src = _random_llama(tmp_path, tokenizer_dir)
    convert_hf_model(FromHFConfig(src, tmp_path / "ckpt", tp_size=2, pp_size=2))
    for path in sorted((tmp_path / "ckpt" / "iter_0000000").glob("mp_rank_*/model_optim_rng.pt")):
        shard = load_shard(path)
        untied = bool(arg(shard["args"], "untie_embeddings_and_output_weights"))
        last = path.parent.name.endswith("_001")
        shard["model"] = to_mcore_model(gpt_flat(shard["model"], str(path), untied), post_process=last)
        if last:
            assert "output_layer.weight" in shard["model"]
            assert "decoder.layers.1.mlp.linear_fc1.weight" in shard["model"]
        save_shard(path, shard)
    assert convert_checkpoint(ToHFConfig(tmp_path / "ckpt", tmp_path / "back")).report.passed
    before, after = load_weights(src), load_weights(tmp_path / "back")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_llamas_slipway_cannot_represent_are_refused(tmp_path, tokenizer_dir):
    _, scaled = _random_llama(tmp_path, tokenizer_dir, "scaled", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    with pytest.raises(CheckpointError, match="rope_type='llama3'"):
        convert_hf_model(FromHFConfig(scaled, tmp_path / "ck"))
    _, src = _random_llama(tmp_path, tokenizer_dir)
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by 4"):
        convert_hf_model(FromHFConfig(src, tmp_path / "ck2", tp_size=4))
