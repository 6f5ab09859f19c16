"""A new stage is one file: tests/orchestrator/toy_stage.py, registered from outside the package, is
planned after preprocess, rendered into its own job script, run by a real local launch on the
preprocessed data, and shown by ``status`` with what it wrote."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from orchestrator import stages
from orchestrator.launch.flow import launch
from orchestrator.readback.status import collect, format_rows
from orchestrator.record.launches import current
from tests.orchestrator import toy_stage
from tests.orchestrator.conftest import compose_cfg
from tests.seam import hook_env
from trainer.data.indexed_dataset import IndexedDataset

TINY = ["+experiment=codeparrot_smoke", "data.corpus.max_files=8", "data.corpus.max_bytes=100000",
        "tokenizer.vocab_size=300", "data.workers=1"]


@pytest.fixture
def registered():
    stages.register(toy_stage.STAGE)
    yield toy_stage.STAGE
    stages.unregister(toy_stage.NAME)
    assert stages.get(toy_stage.NAME) is None


def test_the_toy_stage_is_planned_and_rendered(registered, tmp_path):
    names = [s.name for s in stages.STAGES]
    assert names == ["corpus", "preprocess", "tune", "train", "convert", "eval", "tokencount"]
    result = launch(compose_cfg(TINY + [f"runs_root={tmp_path}", "dry_run=true", "cluster=slurm"]),
                    out=io.StringIO())
    toy = result.plan.stage(toy_stage.NAME)
    assert toy.depends_on == ("preprocess",) and not toy.shared
    assert toy.job.prefixes[0].endswith("data_content_document")
    assert "tokencount  key" in result.text  # the plan's stage list
    script = result.text.split("----- tokencount job script -----")[1]
    assert f"#SBATCH --job-name=codeparrot_smoke-{result.plan.run_id}-tokencount" in script
    assert "#SBATCH --dependency='afterok:<preprocess>'" in script


@pytest.mark.timeout(300)
def test_the_toy_stage_runs_locally_and_shows_in_status(registered, tmp_path, monkeypatch):
    # Training fails at its start (the test seam), so the run is short; the toy stage needs only the data.
    for name, value in hook_env(FAIL_TRAIN="start").items():
        monkeypatch.setenv(name, value)
    cfg = compose_cfg(TINY + [f"runs_root={tmp_path}", "wait=true", "eval=none"])
    with pytest.raises(RuntimeError, match="did not complete"):
        launch(cfg, out=io.StringIO())
    run_dir = next((tmp_path / "codeparrot_smoke").iterdir())
    rows = {r.stage: r for r in collect(str(run_dir))}
    assert rows[toy_stage.NAME].state == "COMPLETED" and rows["train"].state == "FAILED"
    counts_file = Path(rows[toy_stage.NAME].log)
    prep_dir = current(json.loads((run_dir / "run.json").read_text()))["stages"]["preprocess"]["dir"]
    ds = IndexedDataset(str(Path(prep_dir) / "data_content_document"))
    assert len(ds) > 0
    assert json.loads(counts_file.read_text()) == {
        "data_content_document": {"documents": len(ds), "tokens": ds.num_tokens}}
    table = format_rows(list(rows.values()))
    assert "tokencount" in table and str(counts_file) in table
