"""What a local run reports as good is good, across relaunches (issue 50, items 1-3), on the embedded default
(submitit's local executor), as a user would meet each case:

- the run's tokenizer files replaced in place, then a relaunch with more iterations: refused at plan time
  (the checkpoints record another tokenizer), nothing submitted;
- the shared index cache poisoned (a shuffle index overwritten with zeros, same size), then a second run:
  its builder rank rebuilds the entry with a line naming the file, its other rank waits for it, and it
  trains on the real samples (the same first loss as the first run);
- a relaunch with more iterations whose conversion is killed before its model verified: the first launch's
  verified hf/ is still there and loads; the half-done one does not.

One run and one cache, four launches (two of them refused or cut short)."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoModelForCausalLM

from orchestrator.base.problems import PlanError
from orchestrator.launch.flow import RunFailed, launch
from orchestrator.record.launches import history
from tests.orchestrator.conftest import compose_cfg
from tests.orchestrator.test_local_promises import SMALL
from tests.seam import enabled
from trainer.metrics_file import TRAIN_LOSS
from trainer.run_files import COMPLETE, VOCAB_FILE, RunDir

# Two ranks (data parallel): one builds the index cache, the other waits for it.
TWO_RANKS = ["cluster.tasks_per_node=2", "parallel.tp_size=1", "parallel.pp_size=1"]


def _launch(root: Path, run_id: str, *extra: str):
    cfg = compose_cfg([*SMALL, *TWO_RANKS, f"runs_root={root}/runs", f"cache_dir={root}/cache",
                       f"run_id={run_id}", *extra])
    return launch(cfg, out=io.StringIO())


def _first_loss(run: Path) -> float:
    rows = [json.loads(line) for line in RunDir(run).metrics.read_text().splitlines() if line.strip()]
    return next(r[TRAIN_LOSS] for r in rows if r.get("iteration") == 1 and TRAIN_LOSS in r)


def _logs(run: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in run.rglob("*.err"))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_relaunches_never_report_good_on_a_changed_tokenizer_a_poisoned_cache_or_a_half_converted_model(
        tmp_path):
    runs = tmp_path / "runs" / "codeparrot_smoke"
    run = runs / "r"
    _launch(tmp_path, "r", "train.iters=3")
    hf = RunDir(run).hf
    model = (hf / "model.safetensors").read_bytes()

    # 1. The corpus-trained tokenizer replaced in place (two merges swapped): refused before any job.
    merges = next((tmp_path / "cache").rglob(VOCAB_FILE)).with_name("merges.txt")
    before = merges.read_text()
    lines = before.splitlines()
    merges.write_text("\n".join([lines[0], lines[2], lines[1], *lines[3:]]) + "\n")
    with pytest.raises(PlanError) as err:
        _launch(tmp_path, "r", "train.iters=6")
    said = str(err.value)
    assert "[checkpoint_tokenizer]" in said and "was trained with another tokenizer" in said, said
    assert len(history(json.loads((run / "run.json").read_text()))) == 1  # nothing recorded or submitted
    merges.write_text(before)

    # 2. The shared index cache poisoned; a second run (two ranks: one builds, one waits) is not fooled.
    shuffle = next((tmp_path / "cache").rglob("*-train-shuffle_index.npy"))
    np.save(shuffle, np.zeros_like(np.load(shuffle)))
    _launch(tmp_path, "r2", "train.iters=3", "convert.enabled=false")
    said = _logs(runs / "r2")
    assert f"index cache: {shuffle} differs from the SHA-256 recorded when it was built" in said, said[-3000:]
    assert _first_loss(runs / "r2") == pytest.approx(_first_loss(run), rel=1e-5)  # the same samples

    # 3. A relaunch with more iterations whose conversion is killed before its model verified.
    with enabled(CONVERT_FAILPOINT="written"), pytest.raises(RunFailed):
        _launch(tmp_path, "r", "train.iters=6")
    assert json.loads((RunDir(run).stage_state("train") / COMPLETE).read_text())["result"]["iteration"] == 6
    assert (hf / "model.safetensors").read_bytes() == model  # the first launch's verified model
    assert re.search(r"^\| iteration \| 3 \|$", (hf / "README.md").read_text(), re.M)
    AutoModelForCausalLM.from_pretrained(str(hf))
    with pytest.raises((OSError, ValueError), match="config.json"):
        AutoModelForCausalLM.from_pretrained(str(RunDir(run).hf_partial))
