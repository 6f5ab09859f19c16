"""Bad inputs are refused at plan time with the key and the fix (orchestrator/checks/data.py and
tokenizer.py, the checks that read the inputs), before any job exists: a directory or an empty file as
data.paths, a JSONL whose documents are all empty, a corpus that leaves the validation split without a
document, a merges file of another tokenizer; and a corrupt cached dataset (the same case on the devcluster:
test_fault_matrix.py, case 6)."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import numpy as np
import pytest

from orchestrator.base.plan_types import Context
from orchestrator.base.problems import PlanError
from orchestrator.checks.data import reused_data_problems
from orchestrator.launch.flow import launch
from tests.orchestrator.conftest import compose_cfg
from tests.orchestrator.conftest import dry_plan as _plan
from trainer.data.indexed_dataset import IndexedDatasetBuilder


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
    from orchestrator.base.plan_types import Context
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


def _complete_dataset(plan) -> Path:
    """A valid .bin/.idx pair where the plan's preprocessing stage would find it complete."""
    prep = plan.stage("preprocess")
    Path(prep.state_dir).mkdir(parents=True)
    prefix = f"{prep.job[0].output_prefix}_content_document"
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for n in (5, 7, 3):
        builder.add_document(np.arange(n, dtype=np.uint16))
    builder.finalize(prefix + ".idx")
    (Path(prep.state_dir) / "_COMPLETE").write_text("{}")
    return Path(prefix)


def test_truncated_cached_bin_is_a_plan_problem_naming_the_file(tmp_path):
    cfg, plan = _plan(tmp_path)
    prefix = _complete_dataset(plan)
    assert reused_data_problems(Context(cfg, plan=plan)) == []
    with open(f"{prefix}.bin", "r+b") as f:
        f.truncate(20)
    problems = reused_data_problems(Context(cfg, plan=plan))
    assert [p.code for p in problems] == ["data_corrupt"]
    assert f"{prefix}.bin: 20 bytes, but {prefix}.idx describes 30 bytes" in problems[0].message
    out = io.StringIO()
    launch(cfg, out=out)  # the dry run lists it
    assert "[data_corrupt]" in out.getvalue() and "nothing would be submitted" in out.getvalue()


def test_malformed_cached_idx_is_a_plan_problem(tmp_path):
    cfg, plan = _plan(tmp_path)
    prefix = _complete_dataset(plan)
    idx = Path(f"{prefix}.idx")
    idx.write_bytes(idx.read_bytes()[:-8])
    (problem,) = reused_data_problems(Context(cfg, plan=plan))
    assert f"{idx}: " in problem.message and "truncated or corrupt" in problem.message
    assert f"rm -r {plan.stage('preprocess').state_dir}" in problem.fix
