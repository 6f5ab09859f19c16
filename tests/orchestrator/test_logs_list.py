"""``python -m orchestrator logs`` and ``list`` on this machine: a local run's logs (any stage, followed to
the end of a job that has ended), the runs under a ``runs_root`` with their state, iteration and loss, and
one ``squeue`` plus one ``sacct`` call however many Slurm runs ``list`` covers. (On the devcluster:
test_bad_node.py follows a requeued job and lists it.)"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.launch.flow import RunFailed, launch
from orchestrator.world.runs import write_json
from tests.orchestrator.conftest import REPO, compose_cfg
from tests.seam import hook_env
from tests.waits import NEVER_S
from trainer.metrics_file import TRAIN_LOSS, append_record

TINY = ["+experiment=codeparrot_smoke", "data.corpus.max_files=12", "data.corpus.max_bytes=200000",
        "tokenizer.vocab_size=300", "data.workers=1", "eval=none", "convert.enabled=false"]


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=NEVER_S, env=env)


@pytest.mark.timeout(400)
def test_logs_and_list_of_a_local_run(tmp_path, monkeypatch):
    for name, value in hook_env(FAIL_TRAIN="start").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RunFailed):
        launch(compose_cfg(TINY + [f"runs_root={tmp_path}", "wait=true", "run_id=local1"]), out=io.StringIO())
    run = tmp_path / "codeparrot_smoke" / "local1"
    failed = _cli("logs", str(run))  # default: the stage that failed
    assert failed.returncode == 0, failed.stderr
    assert "training failed on purpose" in failed.stdout and "──── train: job " in failed.stderr
    prep = _cli("logs", str(run), "preprocess")
    assert prep.returncode == 0 and "preprocess: 100%" in prep.stdout, prep.stdout[-2000:] + prep.stderr
    tail = _cli("logs", str(run), "train", "-n", "3")
    assert len(tail.stdout.splitlines()) == 3 and tail.stdout in failed.stdout
    follow = _cli("logs", str(run), "train", "--follow")  # the job has ended: its last lines, and back
    assert follow.returncode == 0 and "training failed on purpose" in follow.stdout, follow.stderr
    listed = _cli("logs", str(run), "train", "--list")
    assert "task 0, stderr" in listed.stdout and "_0_log.err" in listed.stdout, listed.stdout
    nojob = _cli("logs", str(run), "train", "--job", "1")
    assert nojob.returncode == 2 and "has no job 1; its jobs: " in nojob.stderr, nojob.stderr
    runs = _cli("list", str(tmp_path))
    row = next(x for x in runs.stdout.splitlines() if x.startswith("codeparrot_smoke/local1 "))
    assert row.split()[1:3] == ["FAILED", "train"], runs.stdout
    # Moved with mv: status, logs and list read it where it stands, and say once where it was launched.
    moved = tmp_path / "elsewhere" / "local1"
    moved.parent.mkdir()
    os.rename(run, moved)
    shown = _cli("status", str(moved))
    assert "FAILED: run local1 stage train" in shown.stdout and "training failed on purpose" in shown.stdout
    assert f"MOVED: run local1 was launched at {run} (launch 1) and now stands at {moved}" in shown.stdout
    again = _cli("logs", str(moved))
    assert again.returncode == 0 and again.stdout == failed.stdout, again.stderr
    runs = _cli("list", str(moved.parent))
    assert runs.stdout.splitlines()[1].split()[:3] == ["local1", "FAILED", "train"], runs.stdout


def _fake_runs(root: Path, n: int) -> None:
    """``n`` runs whose train jobs are Slurm jobs 5000.. with a metrics file of three iterations."""
    for i in range(n):
        run = root / "exp" / f"r{i}"
        run.mkdir(parents=True)
        jobs = {"preprocess": [{"job_id": "4999", "executor": "slurm"}],
                "train": [{"job_id": str(5000 + i), "executor": "slurm"}]}
        write_json(run / "run.json", {"run_id": f"r{i}", "name": f"r{i}", "created": "2026-12-01T10:00:00",
                                      "launches": [{"n": 1, "state": "submitted", "jobs": jobs}]})
        for it in (1, 2, 3):
            append_record(str(run / "train_metrics.jsonl"), {"iteration": it, TRAIN_LOSS: 5.0 - it + i / 10})
        append_record(str(run / "train_metrics.jsonl"), {"iteration": 3, "valid/lm_loss": 9.0})
    (root / "exp" / "sweeps" / "s1").mkdir(parents=True)  # a sweep folder holds no run
    json.dump({"points": []}, (root / "exp" / "sweeps" / "s1" / "sweep.json").open("w"))


def test_list_asks_slurm_once_for_every_run(tmp_path):
    _fake_runs(tmp_path / "runs", 5)
    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # Stand-ins for the two clients, logging each call: job 5000 runs, 5001 failed, the rest completed.
    (bin_dir / "squeue").write_text(f"#!/bin/sh\necho squeue >> {calls}\necho '5000|RUNNING|None'\n")
    (bin_dir / "sacct").write_text(
        f"#!/bin/sh\necho sacct >> {calls}\necho '4999|COMPLETED|0:0|n1|None'\n"
        "echo '5000|RUNNING|0:0|n1|'\necho '5001|FAILED|1:0|n2|None'\n"
        "for j in 5002 5003 5004; do echo \"$j|COMPLETED|0:0|n1|None\"; done\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    out = _cli("list", str(tmp_path / "runs"), env=env)
    assert out.returncode == 0, out.stderr
    assert calls.read_text().split() == ["squeue", "sacct"]  # one call each for five runs
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()[1:]}
    assert set(rows) == {f"exp/r{i}" for i in range(5)}, out.stdout
    assert rows["exp/r0"][1:5] == ["RUNNING", "train", "3", "2.0000"]  # no checkpoint: the column is empty
    assert rows["exp/r1"][1:3] == ["FAILED", "train"] and rows["exp/r4"][1:3] == ["COMPLETED", "train"]
    assert rows["exp/r4"][4] == "2.4000"  # the last training loss, not the validation record after it
