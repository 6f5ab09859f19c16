"""Megatron-layout checkpoints in the shapes of legacy Megatron-LM saves (pickled Namespace args, old key
names, erf GeLU, numpy RNG state, a release folder), all written by Slipway's own writer
(trainer.convert.shards.write_checkpoint) and then edited to look like Megatron-LM's. They show that the
converter reads that layout; they do not show it reads files Megatron-LM itself wrote: genuine Megatron-LM
fixtures come with the issue "The Megatron round trip"."""

from __future__ import annotations

import argparse
import json
import shutil

import numpy as np
import pytest
import torch

from tests.convert.conftest import random_megatron_state, tiny_spec
from trainer.convert.layout import TRACKER, CheckpointError
from trainer.convert.reference import MegatronReference, SlipwayGPTSource
from trainer.convert.shards import write_checkpoint
from trainer.convert.to_hf import ToHFConfig, convert_checkpoint


def _legacy_megatron_layout_checkpoint(tmp_path, tokenizer_dir, tp=2, pp=2):
    """Slipway's writer, then edited into the layout legacy Megatron-LM (~v2–v3) saves, as we understand it:
    a release folder, Namespace args without vocab_size, 'transformer' instead of 'encoder', numpy RNG
    state, checkpoint_version 2.0, erf GeLU."""
    spec = tiny_spec(tp)
    state = random_megatron_state(spec, seed=3)
    ckpt = tmp_path / "megatron_layout"
    iter_dir = write_checkpoint(ckpt, state, {}, 0, (tp, pp))
    release = ckpt / "release"
    iter_dir.rename(release)
    (ckpt / TRACKER).write_text("release")
    args = argparse.Namespace(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                              max_position_embeddings=96, seq_length=96, padded_vocab_size=1024,
                              tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              vocab_file=str(tokenizer_dir / "vocab.json"),
                              merge_file=str(tokenizer_dir / "merges.txt"), bias_gelu_fusion=False,
                              openai_gelu=False, position_embedding_type="learned_absolute",
                              consumed_train_samples=640, data_path=["1.0", "codeparrot_content_document"])
    for shard_dir in release.iterdir():
        path = shard_dir / "model_optim_rng.pt"
        shard = torch.load(path, weights_only=True)
        lm = shard["model"]["language_model"]
        if "encoder" in lm:
            lm["transformer"] = lm.pop("encoder")
        shard.update(args=args, checkpoint_version=2.0, iteration=5000,
                     rng_state=[{"np_rng_state": np.random.get_state()}])
        torch.save(shard, path)
    return ckpt, state, spec


def test_legacy_megatron_layout_checkpoint_needs_trust_pickle(tmp_path, tokenizer_dir):
    """Written by Slipway in the legacy Megatron-LM layout (not by Megatron-LM): refused without
    --trust-pickle (Namespace args), converted and verified with it."""
    ckpt, state, spec = _legacy_megatron_layout_checkpoint(tmp_path, tokenizer_dir)
    with pytest.raises(CheckpointError, match="--trust-pickle"):
        convert_checkpoint(ToHFConfig(ckpt, tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()
    result = convert_checkpoint(ToHFConfig(ckpt, tmp_path / "hf", trust_pickle=True))
    assert result.report.passed and result.spec.activation == "gelu"  # erf GeLU kept, not approximated
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["activation_function"] == "gelu" and cfg["vocab_size"] == 1000
    assert result.provenance.iteration == 5000 and result.provenance.tokens_seen == 640 * 96


def test_numpy_rng_state_loads_without_trust_pickle(tmp_path, tokenizer_dir):
    """Slipway-style dict args plus a numpy RNG state: plain data, allowed without --trust-pickle."""
    spec = tiny_spec()
    state = random_megatron_state(spec)
    args = {"num_attention_heads": 4, "vocab_file": str(tokenizer_dir / "vocab.json"),
            "merge_file": str(tokenizer_dir / "merges.txt")}
    ckpt = tmp_path / "ck"
    path = write_checkpoint(ckpt, state, args, 10, (1, 1)) / "mp_rank_00" / "model_optim_rng.pt"
    shard = torch.load(path, weights_only=True)
    shard["rng_state"] = [{"np_rng_state": np.random.get_state()}]
    torch.save(shard, path)
    assert convert_checkpoint(ToHFConfig(ckpt, tmp_path / "hf")).report.passed


def test_reference_agrees_with_slipway_gpt():
    """The independent Megatron-math forward and trainer.model's GPT compute the same function."""
    spec = tiny_spec(tp=2)
    state = random_megatron_state(spec, seed=7)
    ids = torch.randint(0, spec.vocab_size, (50,))
    a = MegatronReference(state, spec).logits(ids)
    b = SlipwayGPTSource(state, spec).logits(ids)
    assert a.shape == b.shape == (50, spec.vocab_size)
    assert (a - b).abs().max() < 1e-4


def test_tokenizer_found_beside_checkpoint(tmp_path, tokenizer_dir):
    """Moved runs: args point nowhere, but <checkpoint_dir>/tokenizer/ holds the files."""
    spec = tiny_spec()
    ckpt = tmp_path / "ck"
    write_checkpoint(ckpt, random_megatron_state(spec), {"num_attention_heads": 4, "vocab_file": "/x/v.json",
                                                         "merge_file": "/x/m.txt"}, 1, (1, 1))
    shutil.copytree(tokenizer_dir, ckpt / "tokenizer")
    result = convert_checkpoint(ToHFConfig(ckpt, tmp_path / "hf"))
    assert result.report.passed and result.spec.vocab_size == 1000
