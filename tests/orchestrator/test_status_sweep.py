"""Status parsing (squeue/sacct/log lines), the loss plot, and a real local sweep: one preprocess job for
all points, a manifest, distinct W&B names in one group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.readback.status import collect, format_rows, plot
from orchestrator.record.launches import current, current_jobs
from orchestrator.world.progress import log_records
from orchestrator.world.queue import parse_sacct, parse_squeue
from orchestrator.world.runs import write_json
from tests.orchestrator.conftest import REPO
from tests.seam import hook_env
from tests.waits import JOB_S, wait_until
from trainer.checkpoint.files import TRACKER


def test_parse_squeue_and_sacct():
    sq = parse_squeue("101|PENDING|Dependency\n102|RUNNING|None\n")
    assert sq == {"101": ("PENDING", "Dependency"), "102": ("RUNNING", "")}
    sa = parse_sacct(
        "100|COMPLETED|0:0|n1|None\n103|CANCELLED by 0|0:0|None assigned|Dependency\n"
        "104|REQUEUED|0:0|n[1-2]|\n104|COMPLETED|0:0|n[1-2]|\n"
    )
    assert sa["100"]["state"] == "COMPLETED" and sa["103"]["state"] == "CANCELLED"
    assert sa["104"]["state"] == "COMPLETED" and sa["104"]["nodes"] == "n[1-2]"  # last record wins


def _fake_run(root: Path, name: str, losses: list[float]) -> Path:
    run = root / name
    (run / "logs").mkdir(parents=True)
    lines = [
        f" iteration {10 * (i + 1):8d}/     100 | lm loss: {x:.6E} | tokens per second: 123.0 |"
        for i, x in enumerate(losses)
    ]
    (run / "logs" / "train_7_r0_a0_0.err").write_text("\n".join(lines) + "\n")
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("20")
    (run / "stages" / "train").mkdir(parents=True)
    (run / "stages" / "train" / "requeues").write_text("1 requeue\n")
    write_json(run / "wandb_run.json", {"id": "abc123"})
    write_json(
        run / "run.json",
        {
            "run_id": name,
            "name": name,
            "config": {"logging": {"wandb": {"project": "slipway", "entity": "me"}}},
            "jobs": {
                "train": [
                    {
                        "job_id": "999999",
                        "executor": "local",
                        "folder": str(run / "jobs" / "train"),
                        "state_dir": str(run / "stages" / "train"),
                    }
                ]
            },
        },
    )
    return run


@pytest.mark.parametrize("tracker,shown", [("release", 0), ("20\n", 20), ("garbage", None)])
def test_status_reads_the_tracker_as_megatron_does(tmp_path, tracker, shown):
    """A Megatron ``release`` tracker is iteration 0 (a bare int() once showed it as no checkpoint); a
    tracker that names no iteration shows as none rather than failing the table."""
    run = _fake_run(tmp_path, "runA", [5.0])
    (run / "checkpoints" / TRACKER).write_text(tracker)
    assert collect(str(run))[0].checkpoint_iter == shown


def test_collect_table_and_plot(tmp_path):
    a = _fake_run(tmp_path, "runA", [5.0, 4.0, 3.5])
    b = _fake_run(tmp_path, "runB", [5.5, 4.5])
    assert [r[1] for r in log_records(a, "train")] == [5.0, 4.0, 3.5]
    rows = collect(str(a))
    assert len(rows) == 1
    r = rows[0]
    assert (r.stage, r.restarts, r.checkpoint_iter, r.loss, r.tokens_per_s) == ("train", 1, 20, 3.5, 123.0)
    assert r.wandb == "me/slipway/abc123"
    assert "runA" in format_rows(rows)
    sweep = tmp_path / "sweep"
    write_json(
        sweep / "sweep.json",
        {"sweep_id": "s", "points": [{"point": 1, "run_dir": str(b)}, {"point": 0, "run_dir": str(a)}]},
    )
    png = plot(str(sweep), str(tmp_path / "loss.png"))
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator", "status", str(sweep), "--plot"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "runA" in out.stdout and "runB" in out.stdout and (sweep / "loss.png").exists()


def _wait_ended(run_dirs):
    def ended() -> list[str] | None:
        states = [r.state for d in run_dirs for r in collect(str(d))]
        return None if "RUNNING" in states else states

    return wait_until(ended, "the local sweep jobs to end", JOB_S, poll_s=1)


@pytest.mark.timeout(400)
def test_local_sweep_shares_preprocessing(tmp_path):
    cmd = [
        sys.executable,
        "launch.py",
        "-m",
        "+experiment=codeparrot_smoke",
        "optim.lr=1e-3,2e-3",
        f"runs_root={tmp_path}",
        "data.corpus.max_files=12",
        "tokenizer.vocab_size=300",
        "data.workers=1",
        "hydra.sweep.dir=" + str(tmp_path / "sweep"),
    ]
    env = dict(os.environ, WANDB_MODE="offline", **hook_env(FAIL_TRAIN="start"))
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    manifest = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    points = sorted(manifest["points"], key=lambda p: p["point"])
    assert len(points) == 2 and manifest["sweep_id"] == "sweep"
    runs = [Path(p["run_dir"]) for p in points]
    metas = [json.loads((r / "run.json").read_text()) for r in runs]
    # One preprocess job for both points: the second depends on (or reuses) the first one's.
    assert "preprocess" in current_jobs(metas[0]) and "preprocess" not in current_jobs(metas[1])
    assert current(metas[0])["stages"]["preprocess"] == current(metas[1])["stages"]["preprocess"]
    assert "optim.lr=0.001" in points[0]["overrides"] and "optim.lr=0.002" in points[1]["overrides"]
    # Distinct W&B runs in one group named after the sweep.
    w = [current(m)["config"]["logging"]["wandb"] for m in metas]
    tc = [json.loads((r / "run.json").read_text())["name"] for r in runs]
    assert tc[0] != tc[1] and "optim.lr=0.001" in tc[0]
    assert all(x["group"] is None for x in w)  # the group is filled at plan time (trainer config), below
    from orchestrator.stages import TrainStage  # noqa: F401  (the pickles hold the train stage callable)

    _wait_ended(runs)
    # status of the sweep: each point's row carries its overrides beside its state and its failure
    table = subprocess.run([sys.executable, "-m", "orchestrator", "status", str(tmp_path / "sweep")],
                           cwd=REPO, capture_output=True, text=True, timeout=120).stdout
    for run, lr in zip(runs, ("optim.lr=0.001", "optim.lr=0.002"), strict=True):
        row = next(line for line in table.splitlines() if line.startswith(run.name) and " train " in line)
        assert lr in row and "FAILED" in row, table
    import pickle

    groups = set()
    for r in runs:
        pkl = next((r / "jobs" / "train").glob("*_submitted.pkl"))
        delayed = pickle.loads(pkl.read_bytes())
        groups.add(delayed.function.job.trainer_config["logging"]["wandb"]["group"])
    assert groups == {"sweep"}


def test_restarts_count_slurms_requeues_and_slipways_retries(tmp_path):
    from orchestrator.world.progress import restarts as _restarts

    sa = parse_sacct("7|NODE_FAIL|0:0|n2|\n7|RUNNING|0:0|n1|\n8|COMPLETED|0:0|n1|\n")
    assert (sa["7"]["records"], sa["8"]["records"]) == ("2", "1")
    state = tmp_path / "train"
    state.mkdir()
    assert _restarts(state, int(sa["7"]["records"]) - 1) == 1  # a NODE_FAIL requeue by Slurm alone
    (state / "requeues").write_text("1 requeue\n")
    assert _restarts(state, 1) == 1  # Slipway's scontrol requeue is the same restart, not a second one
    assert _restarts(state, 0) == 1  # accounting not caught up yet
    (state / "retries").write_text("1 retry attempt=1\n")
    assert _restarts(state, 1) == 2


def test_status_says_when_slurmctld_does_not_answer(tmp_path, monkeypatch):
    """A controller outage: squeue fails, sacct (slurmdbd) still answers with its last state. Stand-ins
    for the two clients (stopping the shared devcluster's controller would disturb the other tests)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text("#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact slurm "
                                    "controller (connect failure)' >&2\nexit 1\n")
    (bin_dir / "sacct").write_text("#!/bin/sh\necho '4243|RUNNING|0:0|n1|None'\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    run = tmp_path / "r1"
    run.mkdir()
    jobs = {"train": [{"job_id": "4243", "executor": "slurm"}]}
    write_json(run / "run.json", {"run_id": "r1", "jobs": jobs})
    rows = collect(str(run))
    assert rows[0].state == "RUNNING" and "Unable to contact slurm controller" in rows[0].slurm_error
    text = format_rows(rows)
    assert "SLURM: slurmctld did not answer (squeue exited 1: slurm_load_jobs error: Unable" in text
    assert "states above come from accounting (sacct) and may be stale" in text


def test_an_ended_job_shows_no_stale_pending_reason_and_its_ranks_as_a_fraction(tmp_path, monkeypatch):
    """sacct keeps a job's last pending reason ('Dependency') after it ran; a COMPLETED row must not show
    it, a pending one must. Ended ranks read 'exited 2/2', never a bare 'exited 2' (an exit code?)."""
    import time

    from orchestrator.readback import status
    from trainer.health.heartbeat import heartbeat_path

    run = tmp_path / "run"
    jobs = {"train": [{"job_id": "41", "executor": "slurm", "state_dir": str(run / "stages" / "train")}],
            "convert": [{"job_id": "42", "executor": "slurm", "state_dir": str(run / "stages" / "c")}]}
    write_json(run / "run.json", {"run_id": "run", "jobs": jobs})
    for rank in range(2):
        write_json(Path(heartbeat_path(str(run), rank)),
                   {"rank": rank, "host": "n1", "pid": 7, "iteration": 20, "phase": "exited",
                    "time": time.time() - 3600, "interval_s": 10.0})
    acct = {"41": {"state": "COMPLETED", "exit": "0:0", "nodes": "n1", "reason": "Dependency",
                   "records": "1"}}
    monkeypatch.setattr(status, "query_slurm_checked",
                        lambda ids: ({"42": ("PENDING", "Dependency")}, acct, ""))
    rows = {r.stage: r for r in collect(str(run))}
    train = rows["train"]
    assert (train.state, train.reason, train.health) == ("COMPLETED", "", "exited 2/2")
    assert (rows["convert"].state, rows["convert"].reason) == ("PENDING", "Dependency")
    assert "Dependency" not in format_rows([rows["train"]])
