"""Megatron-LM's own checkpoints in, against the logits Megatron computed for them.

``../shared/fixtures/megatron/`` holds checkpoints written by Megatron-LM core_v0.8.0 itself (legacy and
Megatron-core models; torch format at (tp, pp) in {(1,1), (1,2), (2,1), (2,2)}; torch_dist at tp 1 and
2), each with ``expected.pt``: tokens and the logits Megatron's forward computed (its README says how
each was made). They are the oracle here, used as they are. Older naming eras that no fixture covers
('transformer'/'attention' names, checkpoint_version 2.0, a release folder) are exercised at the end
with Slipway-written checkpoints edited into that shape.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.convert.conftest import random_megatron_state, tiny_spec
from tests.fixtures import MEGATRON_FIXTURES as FIXTURES
from trainer.checkpoint import pickles
from trainer.convert.mcore import normalise_names
from trainer.convert.reference import MegatronReference, SlipwayGPTSource
from trainer.convert.shard_io import TRACKER, CheckpointError
from trainer.convert.shards import load_merged, write_checkpoint
from trainer.convert.spec import spec_from_checkpoint
from trainer.convert.to_hf import ToHFConfig, convert_checkpoint

NAMES = ["legacy_tp1_pp1", "legacy_tp1_pp2", "legacy_tp2_pp1", "mcore_tp1_pp1", "mcore_tp2_pp1",
         "mcore_tp2_pp2", "mcore_torch_dist", "mcore_torch_dist_tp2"]
LAYOUT = {"legacy_tp1_pp1": (1, 1), "legacy_tp1_pp2": (1, 2), "legacy_tp2_pp1": (2, 1),
          "mcore_tp1_pp1": (1, 1), "mcore_tp2_pp1": (2, 1), "mcore_tp2_pp2": (2, 2),
          "mcore_torch_dist": (1, 1), "mcore_torch_dist_tp2": (2, 1)}


def test_every_fixture_is_here():
    """The fixtures are part of the checkout (../shared): a missing one is a failure, never a skip."""
    assert sorted(p.name for p in FIXTURES.iterdir() if (p / "expected.pt").is_file()) == sorted(NAMES)


def _tokenizer() -> dict:
    tok = FIXTURES / "tokenizer"
    return {"vocab_file": tok / "vocab.json", "merge_file": tok / "merges.txt"}


@pytest.mark.parametrize("name", NAMES)
def test_megatron_checkpoint_converts_and_reproduces_megatrons_logits(tmp_path, name):
    """to_hf reads the format (legacy ≥ core_v0.4 names, Megatron-core names, torch_dist stacked and
    TE-style names) without --trust-pickle or Megatron, and the HF model gives Megatron's logits."""
    from transformers import GPT2LMHeadModel

    result = convert_checkpoint(ToHFConfig(FIXTURES / name, tmp_path / "hf", **_tokenizer()))
    assert result.report.passed
    assert (result.provenance.iteration, result.provenance.tokens_seen) == (7, 14 * 64)
    assert (result.provenance.tp_size, result.provenance.pp_size) == LAYOUT[name]
    # The args say bias_gelu_fusion=True (Megatron's fused tanh GeLU): the HF model must use the same.
    assert result.spec.activation == "gelu_new"
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["activation_function"] == "gelu_new"
    expected = torch.load(FIXTURES / name / "expected.pt", weights_only=True)
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        logits = model(expected["tokens"]).logits
    assert (logits - expected["logits"]).abs().max().item() <= 1e-4


def test_reading_megatron_needs_no_megatron_and_runs_none_of_its_code():
    """In a fresh interpreter: every fixture's args load; no module named megatron is ever imported."""
    code = ("import sys; from pathlib import Path; from trainer.convert.shards import load_merged\n"
            f"root = Path({str(FIXTURES)!r})\n"
            f"for n in {NAMES!r}:\n"
            "    m = load_merged(root / n / 'iter_0000007', 7)\n"
            "    assert m.args.model_type.value == 1 and m.args.num_layers == 2, n\n"
            "assert not [k for k in sys.modules if k.split('.')[0] == 'megatron']\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


@pytest.mark.parametrize("flags,activation", [({}, "gelu_new"), ({"bias_gelu_fusion": False}, "gelu"),
                                              ({"bias_gelu_fusion": False, "openai_gelu": True}, "gelu_new")])
def test_the_activation_follows_megatrons_gelu_flags(flags, activation):
    """1e-4 cannot tell erf from tanh GeLU on these fixtures (README): the choice must follow the args."""
    merged = load_merged(FIXTURES / "mcore_tp1_pp1" / "iter_0000007", 7)
    args = argparse.Namespace(**{**vars(merged.args), **flags})
    assert spec_from_checkpoint(args, merged.state, merged.checkpoint_version, 1024).activation == activation


def test_the_restricted_reader_refuses_other_globals(tmp_path):
    class_path = tmp_path / "evil.pt"
    torch.save({"args": argparse.Namespace(x=print)}, class_path)  # a callable: would run on a full load
    with pytest.raises(pickles.UnsafePickle, match="builtins.print"):
        pickles.load(str(class_path))


@pytest.mark.parametrize("names,feature", [
    (["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"], "mixture-of-experts"),
    (["decoder.layers.0.mlp.router.weight"], "mixture-of-experts"),
    (["binary_head.weight"], "BERT"),
    (["encoder.layers.0.self_attention.linear_qkv.weight"], "T5"),
    # mcore names all start with "decoder.": that is no hint of T5
    (["decoder.layers.0.self_attention.q_layernorm.weight"], "queries and keys"),
])
def test_unsupported_megatron_variants_are_named(names, feature):
    with pytest.raises(CheckpointError, match=feature):
        normalise_names({n: torch.zeros(1) for n in names}, mcore=True, where=Path("ckpt"))


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


def test_older_legacy_eras_convert(tmp_path, tokenizer_dir):
    """No fixture covers these (Slipway-written, edited): 'transformer'/'attention' names, version 2.0
    QKV order, a release folder, erf GeLU (bias_gelu_fusion False) — and Namespace args need no
    --trust-pickle."""
    ckpt, state, spec = _legacy_megatron_layout_checkpoint(tmp_path, tokenizer_dir)
    result = convert_checkpoint(ToHFConfig(ckpt, tmp_path / "hf"))
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


def test_fp8_and_moe_args_are_refused_with_the_feature_named():
    from trainer.convert.spec import check_convertible as check_gpt2_args

    with pytest.raises(CheckpointError, match="fp8"):
        check_gpt2_args(argparse.Namespace(fp8="hybrid"))
    with pytest.raises(CheckpointError, match="mixture of experts"):
        check_gpt2_args(argparse.Namespace(num_experts=8))


def test_uneven_pipeline_stages_are_numbered_from_zero_each():
    """Newer Megatron splits layers unevenly (--decoder-first/last-pipeline-num-layers): each stage still
    numbers its layers from 0, so global = local + the layers of the stages before."""
    from trainer.convert.shards import _layer_offsets

    assert _layer_offsets([[0, 1, 2], [0], [0, 1]]) == [0, 3, 4]
    assert _layer_offsets([[0, 1, 2], [3], [4, 5]]) == [0, 0, 0]  # already global
    with pytest.raises(CheckpointError, match="inconsistent"):
        _layer_offsets([[0, 1], [1, 2]])
