"""A tokenizer is identified by its content (trainer/data/tokenizer_identity.py): the preprocessing summary
records the tokenizer its data was written with, and the training stage refuses data whose tokenizer is
not the run's (a file replaced between preprocessing and training)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from orchestrator.stages.train import check_data_tokenizer
from tests.convert.conftest import tokenizer_dir as tokenizer_dir  # the fixture
from tests.data.hf_fixtures import build_tokenizer_dir
from trainer.data.hf_tokenizer import HF_TOKENIZER_TYPE, content_hash
from trainer.data.preprocess import PreprocessConfig, PreprocessSummary, preprocess
from trainer.data.tokenizer_identity import SUMMARY_FIELD, identify


def _section(folder) -> dict:
    return {"vocab_file": str(folder / "vocab.json"), "merge_file": str(folder / "merges.txt")}


def _swap_two_merges(folder) -> None:
    """Same vocabulary, same file sizes, another merge order: other ids for some words."""
    lines = (folder / "merges.txt").read_text().splitlines()
    lines[1], lines[2] = lines[2], lines[1]
    (folder / "merges.txt").write_text("\n".join(lines) + "\n")


def test_the_digest_is_the_content_not_the_place(tmp_path, tokenizer_dir):  # noqa: F811 (the fixture)
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(tokenizer_dir, a)
    shutil.copytree(tokenizer_dir, b)
    assert identify(_section(a)).digest == identify(_section(b)).digest  # a copy is the same tokenizer
    _swap_two_merges(b)
    assert identify(_section(a)).digest != identify(_section(b)).digest
    assert identify({"vocab_file": None, "merge_file": None}).digest is None  # pre-tokenized: vocab_size
    assert identify(_section(tmp_path / "gone")).digest is None  # unreadable: the loader says why
    hf = build_tokenizer_dir(["def f(x):\n    return x\n"] * 20, tmp_path / "hf", vocab_size=300)
    assert identify({"type": HF_TOKENIZER_TYPE, "model": str(hf)}).digest == f"sha256:{content_hash(hf)}"


def test_data_tokenized_with_another_tokenizer_is_refused_before_training(tmp_path, tokenizer_dir):  # noqa: F811
    assert SUMMARY_FIELD in {f.name for f in dataclasses.fields(PreprocessSummary)}
    tok = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, tok)
    corpus = tmp_path / "in.jsonl"
    corpus.write_text("".join(json.dumps({"content": f"def f{i}(x):\n    return x * {i}\n"}) + "\n"
                              for i in range(20)))
    summary = preprocess(PreprocessConfig(str(corpus), str(tmp_path / "out" / "data"), **_section(tok),
                                          json_keys=["content"], workers=1, progress="none"))
    assert summary.tokenizer_digest == identify(_section(tok)).digest
    check_data_tokenizer([summary.summary_path], _section(tok))  # the same tokenizer: no complaint

    _swap_two_merges(tok)  # replaced after preprocessing, before training
    with pytest.raises(ValueError) as err:
        check_data_tokenizer([summary.summary_path], _section(tok))
    assert f"the data of {summary.summary_path} was tokenized with another tokenizer" in str(err.value)
    assert f"delete {tmp_path / 'out'} and launch again" in str(err.value)

    record = json.loads(open(summary.summary_path).read())
    del record[SUMMARY_FIELD]  # a summary written before it recorded the tokenizer: not compared
    open(summary.summary_path, "w").write(json.dumps(record))
    check_data_tokenizer([summary.summary_path], _section(tok))
