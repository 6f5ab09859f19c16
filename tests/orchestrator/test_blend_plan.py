"""A weighted blend through the plan (``data.paths=[0.3,a.jsonl,0.7,b.jsonl]``): the dry run shows each
corpus's share of the tokens and its epochs, the weights reach the trainer with the preprocessed prefixes
but not the preprocess key, and a weight <= 0 or a missing file is a plan problem."""

from __future__ import annotations

import io
import json
import os
import re

import pytest

from orchestrator.base.problems import PlanError
from orchestrator.launch.flow import launch
from tests.orchestrator.checks.test_data import _jsonl, _tokenizer
from tests.orchestrator.conftest import compose_cfg


@pytest.fixture
def corpora(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [f"def f{i}(x):\n    return x * {i}\n" * 4 for i in range(300)])
    b = _jsonl(tmp_path / "b.jsonl", [f"print({i})\n" for i in range(60)])
    _TOKENIZER[str(tmp_path)] = _tokenizer(tmp_path)
    return a, b


_TOKENIZER: dict[str, list[str]] = {}  # one trained tokenizer per test (a new one is other files)


def _cfg(tmp_path, paths: list[str], *extra: str):
    return compose_cfg(["+experiment=codeparrot_smoke", "data=codeparrot", f"runs_root={tmp_path}/runs",
                        *_TOKENIZER[str(tmp_path)], f"data.paths=[{','.join(paths)}]", "data.split='90,10,0'",
                        "dry_run=true", *extra])


def test_the_dry_run_shows_each_corpus_share_and_epochs(tmp_path, corpora):
    a, b = corpora
    result = launch(_cfg(tmp_path, ["3", a, "7", b]), out=io.StringIO())
    assert not result.plan.problems, result.plan.problems
    rows = {line.split()[-1]: line for line in result.text.splitlines() if line.rstrip().endswith((a, b))
            and "%" in line}
    assert re.search(r"^\s+30\.0%\s+\(weight 0\.300\).*~[0-9.]+ epochs", rows[a])
    assert re.search(r"^\s+70\.0%\s+\(weight 0\.700\).*~[0-9.]+ epochs", rows[b])
    epochs = {p: float(re.search(r"~([0-9.]+) epochs", rows[p]).group(1)) for p in (a, b)}
    assert epochs[b] > epochs[a]  # the smaller corpus with the larger weight is repeated more

    paths = result.plan.stage("train").job.trainer_config["data"]["paths"]
    prefixes = [f"{c.output_prefix}_content_document" for c in result.plan.stage("preprocess").job]
    assert paths == ["3.0", prefixes[0], "7.0", prefixes[1]]
    assert [c.input for c in result.plan.stage("preprocess").job] == [a, b]
    # The weights select samples, not tokens: the same files keep the same preprocessed data.
    plain = launch(_cfg(tmp_path, [a, b]), out=io.StringIO())
    assert plain.plan.stage("preprocess").key == result.plan.stage("preprocess").key
    assert "Data blend" not in plain.text


def test_exact_epochs_once_the_corpus_is_preprocessed(tmp_path, corpora):
    a, b = corpora
    cfg = _cfg(tmp_path, ["1", a, "1", b])
    prep = launch(cfg, out=io.StringIO()).plan.stage("preprocess").job
    tokens = 12_345
    for c in prep:  # the summary the preprocess job leaves next to its outputs
        os.makedirs(os.path.dirname(c.output_prefix), exist_ok=True)
        with open(c.summary_path, "w") as f:
            json.dump({"tokens": {"content": tokens}}, f)
    text = launch(cfg, out=io.StringIO()).text
    samples = -(-cfg.train.iters * (cfg.train.global_batch_size or 1) // 2)  # ceil(N * 0.5)
    expected = samples * cfg.model.seq_length / (tokens * 0.9)
    rows = [line for line in text.splitlines() if "(weight 0.500)" in line]
    assert len(rows) == 2 and all(f" {expected:.2f} epochs" in r and "~" not in r for r in rows), rows


def test_a_zero_weight_and_a_missing_file_are_plan_problems_together(tmp_path, corpora):
    a, _ = corpora
    missing = str(tmp_path / "nope.jsonl")
    cfg = _cfg(tmp_path, ["0", a, "0.7", missing], "dry_run=false")
    with pytest.raises(PlanError) as err:
        launch(cfg, out=io.StringIO())
    found = {p.code: p for p in err.value.problems}
    assert "entry 0, the weight 0 of" in found["blend"].message and a in found["blend"].message
    assert found["blend"].key == "data.paths" and "raise it" in found["blend"].fix
    missing_files = [(p.key, p.value) for p in err.value.problems if p.code == "file_missing"]
    assert missing_files == [("data.paths", missing)]
