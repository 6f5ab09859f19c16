"""Bad checkpoints and bad requests give clear errors, before anything is written."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

from tests.convert.conftest import make_checkpoint
from trainer.convert.shard_io import TRACKER, CheckpointError
from trainer.convert.to_hf import INVALID, ToHFConfig, VerificationFailed, convert_checkpoint
from trainer.convert.verify import VerifyConfig
from trainer.data.tokenizer_identity import DIGEST_ARG

SHARD = "model_optim_rng.pt"


@pytest.fixture
def ckpt(tmp_path, tokenizer_dir):
    return make_checkpoint(tmp_path, tokenizer_dir, 2, 2)[0]


def _convert(ckpt, tmp_path, **kw):
    return convert_checkpoint(ToHFConfig(ckpt, tmp_path / "out", **kw))


def _edit_shard(path, fn):
    shard = torch.load(path, weights_only=True)
    fn(shard)
    torch.save(shard, path)


def test_missing_directory_and_tracker(tmp_path, ckpt):
    with pytest.raises(CheckpointError, match="does not exist"):
        _convert(tmp_path / "nope", tmp_path)
    (ckpt / TRACKER).unlink()
    no_tracker = r"no latest_checkpointed_iteration.txt.*iter_0000150.*--iteration"
    with pytest.raises(CheckpointError, match=no_tracker):
        _convert(ckpt, tmp_path)
    assert not (tmp_path / "out").exists()
    (ckpt / TRACKER).write_text("15 0")
    with pytest.raises(CheckpointError, match="interrupted"):
        _convert(ckpt, tmp_path)


def test_tracker_points_to_missing_iteration(tmp_path, ckpt):
    (ckpt / TRACKER).write_text("200")
    with pytest.raises(CheckpointError, match=r"says 200 but .*iter_0000200 does not exist.*iter_0000150"):
        _convert(ckpt, tmp_path)
    with pytest.raises(CheckpointError, match="--iteration 7 was asked"):
        _convert(ckpt, tmp_path, iteration=7)
    assert _convert(ckpt, tmp_path, iteration=150).report.passed  # the explicit iteration works


def test_missing_rank_shards(tmp_path, ckpt):
    (ckpt / "iter_0000150" / "mp_rank_01_001" / SHARD).unlink()
    with pytest.raises(CheckpointError, match=r"incomplete for tp=2, pp=2: missing mp_rank_01_001/"):
        _convert(ckpt, tmp_path)
    for d in (ckpt / "iter_0000150").iterdir():
        (d / SHARD).unlink(missing_ok=True)
        d.rmdir()
    with pytest.raises(CheckpointError, match="holds no mp_rank_"):
        _convert(ckpt, tmp_path)


def test_incomplete_or_truncated_shard(tmp_path, ckpt):
    path = ckpt / "iter_0000150" / "mp_rank_00_001" / SHARD
    for t in range(2):  # both TP ranks of the last stage lose the final LayerNorm
        p = ckpt / "iter_0000150" / f"mp_rank_0{t}_001" / SHARD
        _edit_shard(p, lambda s: s["model"]["language_model"]["encoder"].pop("final_layernorm.bias"))
    with pytest.raises(CheckpointError, match="incomplete: no.*final_layernorm.bias"):
        _convert(ckpt, tmp_path)
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="cannot be read"):
        _convert(ckpt, tmp_path)


def test_not_a_gpt(tmp_path, ckpt):
    first = ckpt / "iter_0000150" / "mp_rank_00_000" / SHARD
    _edit_shard(first, lambda s: s["model"].update({"binary_head": {"weight": torch.zeros(2, 64)}}))
    with pytest.raises(CheckpointError, match=r"not a GPT checkpoint.*binary_head.weight"):
        _convert(ckpt, tmp_path)
    _edit_shard(first, lambda s: s.update(model=None) or s.pop("model"))
    with pytest.raises(CheckpointError, match="no 'model' entry"):
        _convert(ckpt, tmp_path)


def test_not_gpt2_architecture(tmp_path, tokenizer_dir):
    ckpt = make_checkpoint(tmp_path, tokenizer_dir, 1, 1, position_embedding_type="rope")[0]
    with pytest.raises(CheckpointError, match="position_embedding_type='rope'"):
        _convert(ckpt, tmp_path)


def test_qkv_bias_alone_is_refused_by_name(tmp_path, tokenizer_dir):
    """add_qkv_bias=True is refused only without the other linear biases, and the message says so
    (with add_bias_linear=True it is what Megatron >= 0.10 writes for GPT-2: tests/mcore/test_model.py)."""
    ckpt = make_checkpoint(tmp_path, tokenizer_dir, 1, 1, add_bias_linear=False, add_qkv_bias=True)[0]
    with pytest.raises(CheckpointError, match="add_qkv_bias=True with add_bias_linear=False"):
        _convert(ckpt, tmp_path)


def test_args_disagree_with_weights_or_tokenizer(tmp_path, tokenizer_dir):
    ckpt = make_checkpoint(tmp_path, tokenizer_dir, 1, 1, hidden_size=128)[0]
    with pytest.raises(CheckpointError, match="args say hidden_size=128 but the weights have 64"):
        _convert(ckpt, tmp_path)
    ckpt = make_checkpoint(tmp_path / "b", tokenizer_dir, 1, 1, vocab_size=999)[0]
    with pytest.raises(CheckpointError, match="vocab_size=999 but .*vocab.json has 1000 tokens"):
        _convert(ckpt, tmp_path)
    ckpt = make_checkpoint(tmp_path / "c", tokenizer_dir, 1, 1, vocab_file="/gone/vocab.json")[0]
    with pytest.raises(CheckpointError, match="tokenizer .* was not found.*--vocab-file"):
        _convert(ckpt, tmp_path)
    # The same size, another vocabulary (the checkpoint records its tokenizer's digest): never shipped.
    ckpt = make_checkpoint(tmp_path / "d", tokenizer_dir, 1, 1, **{DIGEST_ARG: "sha256:" + "0" * 64})[0]
    with pytest.raises(CheckpointError, match=r"trained with another tokenizer \(sha256 000000000000…\) "
                       r"than .*vocab.json \(sha256 [0-9a-f]{12}…\): pass the run's own"):
        _convert(ckpt, tmp_path)


class Unlisted:
    """A class outside what the restricted reader allows (pickled by reference to this test module)."""


def test_namespace_args_load_safely_other_pickles_need_trust_pickle(tmp_path, tokenizer_dir):
    ckpt = make_checkpoint(tmp_path, tokenizer_dir, 1, 1)[0]
    path = ckpt / "iter_0000150" / "mp_rank_00" / SHARD
    shard = torch.load(path, weights_only=True)
    shard["args"] = argparse.Namespace(**shard["args"])
    torch.save(shard, path)
    assert _convert(ckpt, tmp_path).report.passed  # Megatron's Namespace: no --trust-pickle needed
    shard["args"].extra = Unlisted()
    torch.save(shard, path)
    with pytest.raises(CheckpointError, match=r"test_errors.Unlisted.*--trust-pickle"):
        _convert(ckpt, tmp_path, overwrite=True)
    assert _convert(ckpt, tmp_path, trust_pickle=True, overwrite=True).report.passed


def test_output_dir_not_empty_and_failed_verification(tmp_path, ckpt):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="--overwrite"):
        _convert(ckpt, tmp_path)
    assert (out / "keep.txt").read_text() == "user data"
    with pytest.raises(VerificationFailed, match="FAILED"):
        _convert(ckpt, tmp_path, overwrite=True, verify=VerifyConfig(tolerance=1e-12))
    assert (out / "keep.txt").read_text() == "user data"  # replaced only by a verified model
    failed = tmp_path / "out.partial"
    assert "FAILED" in (failed / INVALID).read_text()
    assert not (failed / "config.json").exists()  # nothing loads an unverified model by mistake


def test_verification_detects_a_different_model(tmp_path, tokenizer_dir):
    """Compared against another model, both the logit check and the greedy check fail."""
    from tests.convert.conftest import random_megatron_state
    from trainer.convert.reference import MegatronReference
    from trainer.convert.tokenizer import RunTokenizer, build_hf_tokenizer
    from trainer.convert.verify import verify

    ckpt, _, spec = make_checkpoint(tmp_path, tokenizer_dir, 1, 1)
    _convert(ckpt, tmp_path)
    other = MegatronReference(random_megatron_state(spec, seed=99), spec)
    tok = build_hf_tokenizer(RunTokenizer(tokenizer_dir / "vocab.json", tokenizer_dir / "merges.txt"), 96)
    report = verify(other, tmp_path / "out", tok, VerifyConfig())
    assert not report.passed and not report.greedy_identical and report.max_abs_logit_diff > 0.1


def test_cli_exit_code_and_message(tmp_path, ckpt):
    (ckpt / TRACKER).write_text("999")
    run = subprocess.run([sys.executable, "-m", "trainer.convert.to_hf", "--checkpoint-dir", str(ckpt),
                          "--output-dir", str(tmp_path / "out")], capture_output=True, text=True)
    assert run.returncode == 2
    assert "to_hf: error:" in run.stderr and "iter_0000999 does not exist" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("text,expected", [("release", 0), ("42", 42), ("oops", None)])
def test_the_trainer_and_the_converter_read_a_tracker_alike(tmp_path, text, expected):
    """One reader: Megatron's ``release`` is iteration 0 to both (Megatron reads it so too)."""
    from trainer.checkpoint import protocol as ckpt
    from trainer.convert.shard_io import read_tracker

    (tmp_path / TRACKER).write_text(text)
    if expected is None:
        for read in (ckpt.read_tracker, read_tracker):
            with pytest.raises(CheckpointError, match="'oops', not an iteration number"):
                read(tmp_path if read is read_tracker else str(tmp_path))
    else:
        assert ckpt.read_tracker(str(tmp_path)) == read_tracker(tmp_path) == expected
