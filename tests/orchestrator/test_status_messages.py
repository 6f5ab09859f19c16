"""What ``status`` and ``logs`` say in three cases that used to mislead, each in one line with what to do:

- a run directory moved with ``mv``: its record keeps the absolute paths of where it was launched; the
  readers take them where the run now stands (a completed stage stays COMPLETED, ``logs`` finds the
  files) and say once where it was launched (record/launches.py relocated);
- a launch that stopped early while a job of the run still runs: relaunching would be refused
  (run_active), so the line says to wait for or cancel that job first, naming it;
- a Slurm job squeue answers it does not hold (slurmctld drops ended jobs after MinJobAge): that is an
  answer, not "slurmctld did not answer"; the state is accounting's, else the stage's marker of that job.

(A real local run moved with ``mv`` and read back by the CLI: tests/orchestrator/test_logs_list.py.)
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.readback import logs, status
from orchestrator.record import launches
from orchestrator.record.writer_lock import record_outcomes
from orchestrator.stages.base import mark
from orchestrator.world import queue
from orchestrator.world.runs import write_json
from trainer.run_files import COMPLETE, RUN_JSON, SUBMITIT_LOG, RunDir


def _gone_pid() -> str:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return str(proc.pid)


def _local_entry(run: RunDir, stage: str, job: str) -> dict:
    return {"job_id": job, "executor": "local", "folder": str(run.jobs(stage)),
            "state_dir": str(run.stage_state(stage)), "log_dir": str(run.logs)}


def _finished_run(root: Path, with_run_dir: bool) -> tuple[Path, str]:
    """A run whose local train job completed (submitit's result, its marker, its log) and whose convert
    job is a Slurm one that logged into logs/: as a launch records and the jobs leave them."""
    run = RunDir(root / "runs" / "exp" / "r1")
    job = _gone_pid()
    for stage in ("train", "convert"):
        run.jobs(stage).mkdir(parents=True)
        run.stage_state(stage).mkdir(parents=True)
    (run.jobs("train") / f"{job}_0_result.pkl").write_bytes(pickle.dumps(("success", {})))
    (run.jobs("train") / SUBMITIT_LOG.format(job=job, task=0, stream="err")).write_text("trained\n")
    mark(str(run.stage_state("train")), COMPLETE, {"key": "k", "job": job})
    run.logs.mkdir()
    (run.logs / "convert_77_0.err").write_text("converted\n")
    mark(str(run.stage_state("convert")), COMPLETE, {"key": "k", "job": "77"})
    convert = {**_local_entry(run, "convert", "77"), "executor": "slurm"}
    record = {"n": 1, "state": launches.SUBMITTED, "jobs": {"train": [_local_entry(run, "train", job)],
                                                           "convert": [convert]},
              **({"run_dir": str(run.root)} if with_run_dir else {})}
    write_json(run.run_json, {"run_id": "r1", "launches": [record]})
    return run.root, job


@pytest.mark.parametrize("with_run_dir", [True, False], ids=["recorded", "older-record"])
def test_a_moved_run_is_read_where_it_stands(tmp_path, monkeypatch, with_run_dir):
    old, job = _finished_run(tmp_path / "a", with_run_dir)
    new = tmp_path / "b" / "r1"
    new.parent.mkdir()
    os.rename(old, new)  # mv
    acct = {"77": {"state": "COMPLETED", "exit": "0:0", "nodes": "n1", "reason": "", "records": "1"}}
    monkeypatch.setattr(status, "query_slurm_checked", lambda ids: ({}, acct, ""))
    rows = {r.stage: r for r in status.collect(str(new))}
    assert {s: r.state for s, r in rows.items()} == {"train": "COMPLETED", "convert": "COMPLETED"}
    assert not any(r.failure for r in rows.values())
    [note] = [n for n in status.launch_notes(str(new), list(rows.values())) if n]
    assert note == (f"MOVED: run r1 was launched at {old} (launch 1) and now stands at {new}: status and "
                    f"logs read it here, but a job still running writes to {old}; to launch it again here, "
                    f"add run_dir={new} to its overrides")
    _, files = logs.pick(new, "train", logs.Selection())
    assert [f.path.read_text() for f in files] == ["trained\n"]
    _, files = logs.pick(new, "convert", logs.Selection())
    assert [f.path for f in files] == [new / "logs" / "convert_77_0.err"]
    # A relaunch from the new place records the earlier launch's outcome as it was, not ENDED.
    record = launches.LaunchRecord.load(new)
    monkeypatch.setattr("orchestrator.record.writer_lock.query_slurm", lambda ids: ({}, acct))
    record_outcomes(record)
    assert launches.read(new)["launches"][0]["outcome"] == {"train": "COMPLETED", "convert": "COMPLETED"}
    assert str(old) in (new / RUN_JSON).read_text()  # the record itself keeps where it ran


def test_a_copied_run_is_read_where_its_jobs_wrote(tmp_path):
    """A copy leaves the original in place, where its jobs (maybe still running) write: that is read."""
    old, _ = _finished_run(tmp_path / "a", True)
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(old), str(copy)], check=True)
    for done in [old / "stages" / "train" / COMPLETE, *(old / "jobs" / "train").glob("*_result.pkl")]:
        done.unlink()  # the original changes after the copy was taken
    data = launches.read(copy)
    assert launches.moves(data, copy) == [] and launches.relocated(data, copy) is data
    assert status.collect(str(copy))[0].state == "ENDED"  # read at the original, not the copy


def _stopped_launch(root: Path, job: str, pending: dict) -> Path:
    run = RunDir(root / "r1")
    run.stage_state("train").mkdir(parents=True)
    run.jobs("train").mkdir(parents=True)
    record = {"n": 1, "state": launches.SUBMITTING, "host": "this", "pid": int(_gone_pid()),
              "started": "2026-12-07T10:00:00", "pending": pending,
              "jobs": {"train": [_local_entry(run, "train", job)]}}
    write_json(run.run_json, {"run_id": "r1", "launches": [record]})
    return run.root


def test_a_stopped_launch_whose_job_still_runs_is_not_told_to_relaunch(tmp_path):
    run = _stopped_launch(tmp_path, "0", {"convert": {"comment": "", "at": "x"}})
    # The train job's controller: a process whose command line names its submitit folder.
    code = "import sys; print('up', flush=True); sys.stdin.read()"
    proc = subprocess.Popen([sys.executable, "-c", code, str(RunDir(run).jobs("train"))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"up\n"  # it runs its own command line now, not pytest's
        data = launches.read(run)
        data["launches"][0]["jobs"]["train"][0]["job_id"] = str(proc.pid)
        write_json(run / RUN_JSON, data)
        [line] = [n for n in status.launch_notes(str(run)) if n]
        assert line.startswith("LAUNCH INCOMPLETE: run r1 launch 1 (started 2026-12-07T10:00:00) stopped "
                               "while submitting (convert); the stages above are all it submitted, and ")
        assert f"train job {proc.pid} (RUNNING) still queued or running" in line, line
        assert "[run_active]" in line and f"python -m orchestrator cancel {run}" in line, line
        assert "Launch the same run_id again to reconcile" not in line
    finally:
        proc.communicate(b"")  # it ends
    [line] = [n for n in status.launch_notes(str(run)) if n]  # it ended: relaunching resumes the run
    assert line.endswith("Launch the same run_id again to reconcile and resume it."), line


def test_a_job_the_stopped_launch_left_unrecorded_counts_too(tmp_path, monkeypatch):
    """A launch killed between sbatch and recording the id: the relaunch would adopt the job (found by its
    comment) and be refused while it runs; status names it."""
    comment = "slipway:abc:1:convert"
    run = _stopped_launch(tmp_path, _gone_pid(), {"convert": {"comment": comment, "at": "x"}})
    monkeypatch.setattr(queue, "jobs_by_comment", lambda comments: {comment: ("4242", "PENDING")})
    [line] = [n for n in status.launch_notes(str(run)) if n]
    assert "convert job 4242 (PENDING, submitted by launch 1 without being recorded) still queued" in line, \
        line


def _fake_slurm(tmp_path: Path, monkeypatch, squeue: str, sacct: str = "") -> None:
    """squeue and sacct stand-ins: each prints what it is given (squeue's text: stderr, exit 1)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "squeue").write_text(f"#!/bin/sh\necho '{squeue}' >&2\nexit 1\n")
    (bin_dir / "sacct").write_text(f"#!/bin/sh\nprintf '{sacct}'\n")
    for name in ("squeue", "sacct"):
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def _slurm_run(root: Path, job: str) -> Path:
    run = RunDir(root / "run")
    run.stage_state("train").mkdir(parents=True)
    entry = {"job_id": job, "executor": "slurm", "state_dir": str(run.stage_state("train"))}
    write_json(run.run_json, {"run_id": "run", "launches": [{"n": 1, "jobs": {"train": [entry]}}]})
    return run.root


# squeue 22.05 on a job id slurmctld does not hold (seen on the devcluster for a purged job).
UNKNOWN = "slurm_load_jobs error: Invalid job id specified"


def test_a_job_squeue_no_longer_knows_is_an_answer_not_an_outage(tmp_path, monkeypatch):
    run = _slurm_run(tmp_path, "77")
    _fake_slurm(tmp_path, monkeypatch, UNKNOWN, "77|COMPLETED|0:0|n1|None|77\\n")
    assert queue.query_slurm_checked(["77"])[2] == ""
    rows = status.collect(str(run))
    assert rows[0].state == "COMPLETED" and not rows[0].slurm_error
    assert "slurmctld did not answer" not in status.format_rows(rows)


def test_a_job_neither_squeue_nor_accounting_knows_ended_as_its_marker_says(tmp_path, monkeypatch):
    run = _slurm_run(tmp_path, "77")
    _fake_slurm(tmp_path, monkeypatch, UNKNOWN)
    [row] = status.collect(str(run))
    assert row.state == "ENDED" and row.failure.startswith("ENDED; Slurm no longer knows this job"), row
    assert "slurmctld did not answer" not in status.format_rows([row])
    mark(str(run / "stages" / "train"), COMPLETE, {"key": "k", "job": "77"})
    assert status.collect(str(run))[0].state == "COMPLETED"


def test_squeue_failing_otherwise_is_still_an_outage(tmp_path, monkeypatch):
    run = _slurm_run(tmp_path, "77")
    _fake_slurm(tmp_path, monkeypatch, "slurm_load_jobs error: Unable to contact slurm controller",
                "77|RUNNING|0:0|n1|None|77\\n")
    rows = status.collect(str(run))
    assert rows[0].state == "RUNNING" and "Unable to contact" in rows[0].slurm_error
    assert "SLURM: slurmctld did not answer" in status.format_rows(rows)


@pytest.mark.slurm
def test_on_slurm_a_job_id_slurmctld_does_not_hold_is_no_outage(tmp_path):
    """The real squeue and sacct, asked about an id no job has (squeue's answer for a purged job is the
    same): no outage note; neither knows it, and the stage left no marker of it, so ENDED, saying so."""
    run = _slurm_run(tmp_path, "2147483000")
    sq, sa, error = queue.query_slurm_checked(["2147483000"])
    assert (sq, sa, error) == ({}, {}, "")
    text = status.format_rows(status.collect(str(run)))
    assert "slurmctld did not answer" not in text and "ENDED; Slurm no longer knows this job" in text, text
