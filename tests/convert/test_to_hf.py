"""Slipway checkpoint → Hugging Face: parity at every layout, the files users load, the tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from tests.convert.conftest import VOCAB, make_checkpoint
from trainer.convert.to_hf import INVALID, ToHFConfig, convert_checkpoint, main


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_parity_at_every_layout(tmp_path, tokenizer_dir, tp, pp):
    ckpt, _, spec = make_checkpoint(tmp_path, tokenizer_dir, tp, pp)
    assert spec.padded_vocab_size == 1024 > VOCAB  # padding rows exist and must be dropped
    result = convert_checkpoint(ToHFConfig(ckpt, tmp_path / "hf"))
    rep = result.report
    assert rep.passed and rep.greedy_identical and rep.max_abs_logit_diff <= 1e-4
    assert rep.new_tokens == 32 and len(rep.samples) == 4
    assert (result.provenance.tp_size, result.provenance.pp_size) == (tp, pp)
    assert not (tmp_path / "hf" / INVALID).exists()


def test_output_files_config_and_card(converted, tokenizer_dir):
    hf_dir, _, _, spec, result = converted
    names = {p.name for p in hf_dir.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "README.md", "vocab.json",
            "merges.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= names
    cfg = json.loads((hf_dir / "config.json").read_text())
    eod = json.loads((tokenizer_dir / "vocab.json").read_text())["<|endoftext|>"]
    assert cfg["vocab_size"] == VOCAB and cfg["n_embd"] == 64 and cfg["n_layer"] == 4 and cfg["n_head"] == 4
    assert cfg["n_inner"] == 256 and cfg["n_positions"] == 96
    assert cfg["activation_function"] == "gelu_new" and cfg["layer_norm_epsilon"] == 1e-5
    assert cfg["bos_token_id"] == cfg["eos_token_id"] == cfg["pad_token_id"] == eod
    assert cfg["torch_dtype"] == "float32" and cfg["architectures"] == ["GPT2LMHeadModel"]
    gen = json.loads((hf_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == eod
    card = (hf_dir / "README.md").read_text()
    for needle in ("test-run", "| iteration | 150 |", "115,200", "tiny_text_document", "tp=2, pp=2",
                   "verification PASSED", "greedy 32-token generation identical"):
        assert needle in card, needle
    assert f"{result.report.max_abs_logit_diff:.3g}" in card


def test_transformers_loads_and_generates(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    hf_dir = converted[0]
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    assert type(model).__name__ == "GPT2LMHeadModel"
    tok = AutoTokenizer.from_pretrained(hf_dir)
    text = "def f(x):\n    return {'a': [1, 2.5]}  # ünïcode ✓<|endoftext|>"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert ids[-1] == tok.eos_token_id == model.config.eos_token_id
    assert len(tok) == model.config.vocab_size == VOCAB
    out = pipeline("text-generation", model=str(hf_dir))("import json\n", max_new_tokens=8, do_sample=False)
    assert out[0]["generated_text"].startswith("import json\n")
    assert len(tok(out[0]["generated_text"])["input_ids"]) > len(tok("import json\n")["input_ids"])


def test_ids_match_the_training_tokenizer(converted, tokenizer_dir):
    """The HF tokenizer gives the ids the run's byte-level BPE gave during training."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import AutoTokenizer

    train_tok = ByteLevelBPETokenizer(str(tokenizer_dir / "vocab.json"), str(tokenizer_dir / "merges.txt"))
    hf_tok = AutoTokenizer.from_pretrained(converted[0])
    text = "class Foo(object):\n\tdef bar(self):  pass\n\n# 123 héllo"
    assert hf_tok(text)["input_ids"] == train_tok.encode(text).ids


def test_bin_format_sharding_and_bf16(tmp_path, tokenizer_dir):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ckpt, state, _ = make_checkpoint(tmp_path, tokenizer_dir, 1, 2)
    code = main(["--checkpoint-dir", str(ckpt), "--output-dir", str(tmp_path / "hf"), "--format", "bin",
                 "--max-shard-size", "100KB", "--dtype", "bfloat16"])
    assert code == 0
    out = tmp_path / "hf"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((out / f).stat().st_size < 150_000 for f in files)
    assert (out / "pytorch_model.bin").is_file()
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    wte = load_file(str(out / index["weight_map"]["transformer.wte.weight"]))["transformer.wte.weight"]
    assert wte.dtype == torch.bfloat16
    assert torch.equal(wte, state["language_model.embedding.word_embeddings.weight"][:VOCAB].bfloat16())
    model = AutoModelForCausalLM.from_pretrained(out, use_safetensors=False)
    assert torch.equal(model.transformer.wte.weight, wte)
