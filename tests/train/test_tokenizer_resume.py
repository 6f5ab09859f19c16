"""A checkpoint records the tokenizer it was trained with (by content: trainer.data.tokenizer_identity) and
the trainer compares it before loading anything: a resume with other vocab/merges is refused with the fix,
``checkpoint.load=model-only`` from another run's checkpoints is the explicit way to change tokenizers, and
checkpoints without the record (Megatron-LM's own, an older Slipway's) load with a note."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tests.fixtures import MEGATRON_FIXTURES
from tests.logs import captured
from tests.train.harness import run_cfg, tiny_config, write_dataset
from trainer.checkpoint.files import CheckpointError, arg
from trainer.checkpoint.protocol import read_tracker, saved_layout
from trainer.data.tokenizer_identity import DIGEST_ARG, identify, unrecorded_note
from trainer.restore.state import check_tokenizer
from trainer.run import entry


def write_tokenizer(folder: Path, merges: list[str]) -> dict[str, str]:
    """A tiny GPT-2 BPE pair (the model's vocab_size, 200, is set apart): the tokenizer section."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<|endoftext|>": 0, **{chr(ord("a") + i): i + 1 for i in range(26)}, "ab": 27, "cd": 28}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{m}\n" for m in merges))
    return {"vocab_file": str(folder / "vocab.json"), "merge_file": str(folder / "merges.txt")}


A_MERGES, B_MERGES = ["a b", "c d"], ["c d", "a b"]  # the same entries, another merge order: other ids


def _cfg(run: Path, data: str, tok: dict, iters: int, **sections) -> dict:
    return tiny_config(str(run), data, tokenizer=tok, train={"iters": iters, "save_interval": 2,
                                                             "eval_interval": 1000}, **sections)


def test_resuming_with_another_tokenizer_is_refused_before_loading_and_model_only_is_the_way_out(
        tmp_path, monkeypatch):
    data = write_dataset(str(tmp_path / "data"))
    tok = write_tokenizer(tmp_path / "tok", A_MERGES)
    run = tmp_path / "run"
    run_cfg(_cfg(run, data, tok, 2))
    ckpt = str(run / "checkpoints")
    recorded = arg(saved_layout(ckpt, 2)[2], DIGEST_ARG)
    assert recorded == identify(tok).digest and recorded.startswith("sha256:")

    write_tokenizer(tmp_path / "tok", B_MERGES)  # replaced in place, same run: refused before any load
    monkeypatch.setattr(entry, "restore_same_layout", lambda *a: pytest.fail("loaded before the check"))
    with pytest.raises(CheckpointError) as err:
        run_cfg(_cfg(run, data, tok, 4))
    text = str(err.value)
    assert f"checkpoint {ckpt} iteration 2 was trained with another tokenizer (sha256 {recorded[7:19]}…)" \
        in text
    assert f"this run's {tok['vocab_file']} + {tok['merge_file']}" in text
    assert f"another run_id), from these weights with the new tokenizer by checkpoint.load=model-only " \
        f"checkpoint.load_dir={ckpt}" in text
    assert read_tracker(ckpt) == 2
    monkeypatch.undo()

    new_run = tmp_path / "new_run"  # the explicit way: a new run, weights only, the new tokenizer
    with captured() as lines:
        result = run_cfg(_cfg(new_run, data, tok, 2, checkpoint={"load": "model-only", "load_dir": ckpt}))
    assert result.exit_code == 0
    assert any(f"checkpoint.load=model-only: starting from the weights of {ckpt} iteration 2, trained with "
               "another tokenizer" in ln for ln in lines), lines
    assert arg(saved_layout(str(new_run / "checkpoints"), 2)[2], DIGEST_ARG) == identify(tok).digest

    write_tokenizer(tmp_path / "tok", A_MERGES)  # the files it was trained with, back: it resumes
    assert run_cfg(_cfg(run, data, tok, 4)).iteration == 4


def test_checkpoints_without_a_record_load_with_a_note(tmp_path):
    tok = identify(write_tokenizer(tmp_path / "tok", A_MERGES))
    fixture = str(MEGATRON_FIXTURES / "legacy_tp1_pp1")
    megatron_args = saved_layout(fixture, 7, mmap=True)[2]  # Megatron-LM's own: no such field
    older = argparse.Namespace(num_layers=2)  # an older Slipway's args: none either
    for args, where in ((megatron_args, fixture), (older, "old")):
        for model_only in (True, False):
            with captured() as lines:
                check_tokenizer(args, tok, (where, 7, model_only))
            assert lines == [unrecorded_note(where, 7)]
            assert f"{where} iteration 7 records no tokenizer (written by Megatron-LM" in lines[0]
    with pytest.raises(CheckpointError, match="trained with another tokenizer"):
        check_tokenizer(argparse.Namespace(**{DIGEST_ARG: "sha256:" + "0" * 64}), tok, ("d", 7, False))
    check_tokenizer(argparse.Namespace(**{DIGEST_ARG: tok.digest}), tok, ("d", 7, False))  # its own: fine
