"""Bad inputs are refused at plan time with the key and the fix (orchestrator/checks/data.py and
tokenizer.py, the checks that read the inputs), before any job exists: a directory or an empty file as
data.paths, a JSONL whose documents are all empty, a corpus that leaves the validation split without a
document, a merges file of another tokenizer."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import pytest

from orchestrator.flow import launch
from orchestrator.problems import PlanError
from tests.orchestrator.conftest import compose_cfg


def _tokenizer(tmp_path: Path) -> list[str]:
    """A small real tokenizer (vocab.json + merges.txt that belong together)."""
    from trainer.data.train_tokenizer import TokenizerTrainConfig, train_tokenizer

    corpus = tmp_path / "tok.jsonl"
    corpus.write_text("".join(json.dumps({"content": f"def f{i}(x):\n    return x + {i}\n"}) + "\n"
                              for i in range(200)))
    out = tmp_path / "tok"
    train_tokenizer(TokenizerTrainConfig([str(corpus)], str(out), vocab_size=300))
    return [f"tokenizer.vocab_file={out}/vocab.json", f"tokenizer.merge_file={out}/merges.txt"]


def _problems(tmp_path: Path, data: list[str], *extra: str) -> list:
    cfg = compose_cfg(["+experiment=codeparrot_smoke", "data=codeparrot", f"runs_root={tmp_path}/runs",
                       *_tokenizer(tmp_path), f"data.paths=[{','.join(data)}]", *extra])
    with pytest.raises(PlanError) as err:
        launch(cfg, out=io.StringIO())
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("run.json"))
    return err.value.problems


def _jsonl(path: Path, docs: list[str]) -> str:
    path.write_text("".join(json.dumps({"content": d}) + "\n" for d in docs))
    return str(path)


def test_a_directory_as_data_paths(tmp_path):
    (tmp_path / "d").mkdir()
    p = next(p for p in _problems(tmp_path, [str(tmp_path / "d")]) if p.code == "data_is_dir")
    assert p.key == "data.paths" and "directory" in p.message and "part1.jsonl" in p.fix


EMPTY_DOCS = json.dumps({"content": ""}) + "\n" + json.dumps({"text": "x"}) + "\n"


@pytest.mark.parametrize("content", ["", EMPTY_DOCS])
def test_an_empty_file_or_only_empty_documents(tmp_path, content):
    (tmp_path / "e.jsonl").write_text(content)
    p = next(p for p in _problems(tmp_path, [str(tmp_path / "e.jsonl")]) if p.code == "data_empty")
    assert p.key == "data.paths" and p.value == str(tmp_path / "e.jsonl") and "data.json_key" in p.fix


def test_gzip_inputs_are_scanned_too(tmp_path):
    path = tmp_path / "e.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"content": ""}) + "\n")
    assert [p.code for p in _problems(tmp_path, [str(path)]) if p.code.startswith("data")] == ["data_empty"]


def test_one_big_document_leaves_validation_without_data(tmp_path):
    path = _jsonl(tmp_path / "one.jsonl", ["x = 1\n" * 50_000])
    p = next(p for p in _problems(tmp_path, [path], "data.split='969,30,1'") if p.code == "data_split")
    assert p.key == "data.split" and "valid split needs" in p.message
    assert "of the 1 in data.paths" in p.message


def test_enough_documents_pass_the_split_check(tmp_path):
    from orchestrator.checks import Context
    from orchestrator.checks.data import data_problems

    path = _jsonl(tmp_path / "many.jsonl", [f"print({i})" for i in range(100)])
    cfg = compose_cfg(["+experiment=codeparrot_smoke", "data=codeparrot", f"data.paths=[{path}]",
                       "data.split='80,20,0'"])
    assert data_problems(Context(cfg)) == []


def test_a_merges_file_of_another_tokenizer_names_both_files(tmp_path):
    tok = _tokenizer(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    merges = Path(tok[1].split("=", 1)[1])
    lines = merges.read_text().split("\n")
    (other / "merges.txt").write_text("\n".join(lines[:1] + ["qz xv"] + lines[1:]))
    path = _jsonl(tmp_path / "ok.jsonl", [f"print({i})" for i in range(100)])
    cfg = compose_cfg(["+experiment=codeparrot_smoke", "data=codeparrot", f"runs_root={tmp_path}/runs",
                       f"data.paths=[{path}]", tok[0], f"tokenizer.merge_file={other}/merges.txt"])
    with pytest.raises(PlanError) as err:
        launch(cfg, out=io.StringIO())
    p = next(p for p in err.value.problems if p.code == "tokenizer_invalid")
    assert p.key == "tokenizer.merge_file" and str(other / "merges.txt") in p.message
    assert "vocab.json" in p.message and "'qz'" in p.message
