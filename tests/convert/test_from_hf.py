"""Hugging Face → Slipway checkpoint, and round trips in both directions."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from tests.convert.conftest import VOCAB, make_checkpoint
from trainer.convert import names
from trainer.convert.from_hf import FromHFConfig, convert_hf_model
from trainer.convert.hf_io import load_weights
from trainer.convert.shard_io import CheckpointError
from trainer.convert.shards import load_merged
from trainer.convert.to_hf import ToHFConfig, convert_checkpoint

SHARD = "model_optim_rng.pt"


def _random_gpt2(tmp_path, tokenizer_dir, **overrides):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    kwargs = {"vocab_size": VOCAB, "n_positions": 80, "n_embd": 48, "n_layer": 4, "n_head": 4,
              "initializer_range": 0.2, "eos_token_id": 0, "bos_token_id": 0, **overrides}
    model = GPT2LMHeadModel(GPT2Config(**kwargs)).eval()
    # Random LayerNorm/bias values too, so every tensor's mapping is exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path / "gpt2"
    model.save_pretrained(out)
    for f in ("vocab.json", "merges.txt"):
        shutil.copyfile(tokenizer_dir / f, out / f)
    return model, out


def test_random_gpt2_in_and_out_identical(tmp_path, tokenizer_dir):
    from transformers import AutoModelForCausalLM

    model, src = _random_gpt2(tmp_path, tokenizer_dir)
    report = convert_hf_model(FromHFConfig(src, tmp_path / "ckpt", tp_size=2, pp_size=2))
    assert report.passed
    assert (tmp_path / "ckpt" / "iter_0000000" / "mp_rank_01_001" / "model_optim_rng.pt").is_file()
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "0"
    convert_checkpoint(ToHFConfig(tmp_path / "ckpt", tmp_path / "back"))
    before, after = load_weights(src), load_weights(tmp_path / "back")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)  # HF → Slipway → HF is exact
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    x = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        assert torch.equal(model(x).logits, back(x).logits)


def test_slipway_hf_slipway_exact(tmp_path, tokenizer_dir):
    ckpt, state, spec = make_checkpoint(tmp_path, tokenizer_dir, 2, 1)
    convert_checkpoint(ToHFConfig(ckpt, tmp_path / "hf"))
    convert_hf_model(FromHFConfig(tmp_path / "hf", tmp_path / "again", tp_size=1, pp_size=2))
    again = load_merged(tmp_path / "again" / "iter_0000000", 0).state
    assert again.keys() == state.keys()
    for k, v in state.items():
        if k == names.WORD_EMBEDDINGS:  # padding rows are not part of the model
            assert torch.equal(again[k][:VOCAB], v[:VOCAB]) and not again[k][VOCAB:].any()
        else:
            assert torch.equal(again[k], v), k


def test_loadable_by_slipway_checkpoint_and_model(tmp_path, tokenizer_dir):
    """The written shards are what trainer.checkpoint / trainer.model load (safe torch.load, exact names)."""
    from trainer.checkpoint.protocol import load_file, saved_layout
    from trainer.config.model import ModelConfig
    from trainer.model import GPT, StageSpec, load_megatron_state_dict

    _, src = _random_gpt2(tmp_path, tokenizer_dir)
    convert_hf_model(FromHFConfig(src, tmp_path / "ckpt", tp_size=1, pp_size=2))
    tp, pp, args = saved_layout(str(tmp_path / "ckpt"), 0)
    assert (tp, pp) == (1, 2) and args.vocab_size == VOCAB and args.padded_vocab_size == 1024
    assert args.bias_gelu_fusion and not args.openai_gelu  # the same Namespace form as a trained run's
    cfg = ModelConfig(num_layers=4, hidden_size=48, num_attention_heads=4, seq_length=80, vocab_size=VOCAB)
    for stage, (start, end) in enumerate([(0, 2), (2, 4)]):
        model = GPT(cfg, StageSpec(start, end, pre_process=stage == 0, post_process=stage == 1), 1024)
        shard = load_file(str(tmp_path / "ckpt" / "iter_0000000" / f"mp_rank_00_00{stage}" / SHARD))
        load_megatron_state_dict(model, shard["model"])


def test_cli_and_refusals(tmp_path, tokenizer_dir):
    _, src = _random_gpt2(tmp_path, tokenizer_dir)
    run = subprocess.run([sys.executable, "-m", "trainer.convert.from_hf", "--model-dir", str(src),
                          "--output-dir", str(tmp_path / "ck"), "--tp", "3"], capture_output=True, text=True)
    assert run.returncode == 2 and "n_head=4 is not divisible by 3" in run.stderr
    assert not (tmp_path / "ck").exists()  # refused before writing anything
    _, erf = _random_gpt2(tmp_path / "erf", tokenizer_dir, activation_function="gelu")
    with pytest.raises(CheckpointError, match="activation_function='gelu'"):
        convert_hf_model(FromHFConfig(erf, tmp_path / "ck2"))


def test_unprefixed_bin_only_directory(tmp_path, tokenizer_dir):
    """openai-community/gpt2 stores names without ``transformer.``; older dirs hold only pytorch_model.bin."""
    model, src = _random_gpt2(tmp_path, tokenizer_dir)
    (src / "model.safetensors").unlink()
    state = {k.removeprefix("transformer."): v for k, v in model.state_dict().items()
             if k != "lm_head.weight"}
    torch.save(state, src / "pytorch_model.bin")
    assert convert_hf_model(FromHFConfig(src, tmp_path / "ck", tp_size=2)).passed
    merged = load_merged(tmp_path / "ck" / "iter_0000000", 0).state
    assert torch.equal(merged[names.WORD_EMBEDDINGS][:VOCAB], model.transformer.wte.weight)
