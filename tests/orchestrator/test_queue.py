"""orchestrator/world/queue.py: each Slurm job state maps to one category, local liveness, and the blocking
wait built on them."""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from orchestrator.launch import flow
from orchestrator.world import queue
from tests.waits import NEVER_S, wait_until
from trainer.run_files import COMPLETE, LOCAL_EXITS

# Slurm's job states (squeue --help / sacct's JOB STATE CODES), each with the category it must have.
SLURM_STATES = {
    "BOOT_FAIL": "failed",
    "CANCELLED": "cancelled",
    "COMPLETED": "done",
    "COMPLETING": "running",
    "CONFIGURING": "running",
    "DEADLINE": "failed",
    "FAILED": "failed",
    "NODE_FAIL": "failed",
    "OUT_OF_MEMORY": "failed",
    "PENDING": "pending",
    "PREEMPTED": "failed",
    "RESV_DEL_HOLD": "pending",
    "REQUEUE_FED": "pending",
    "REQUEUE_HOLD": "pending",
    "REQUEUED": "pending",
    "RESIZING": "running",
    "REVOKED": "cancelled",
    "RUNNING": "running",
    "SIGNALING": "running",
    "SPECIAL_EXIT": "pending",
    "STAGE_OUT": "running",
    "STOPPED": "running",
    "SUSPENDED": "running",
    "TIMEOUT": "failed",
}


@pytest.mark.parametrize("state,expected", sorted(SLURM_STATES.items()))
def test_every_slurm_state_has_its_category(state, expected):
    assert queue.category(state) == expected
    assert queue.alive(state) == (expected in ("pending", "running"))
    assert queue.ended(state) != queue.alive(state)


def test_the_vocabulary_is_exactly_slurms_plus_the_local_word():
    assert queue.STATES == set(SLURM_STATES) | {"ENDED"}
    assert queue.ACTIVE | queue.ENDED == queue.STATES and not queue.ACTIVE & queue.ENDED
    assert set(queue.CATEGORIES) == set(SLURM_STATES.values())


@pytest.mark.parametrize("text", ["CANCELLED by 123", "CANCELLED by 0", "CANCELLED+", " cancelled \n"])
def test_sacct_forms_of_a_state(text):
    assert queue.normalize(text) == "CANCELLED" and queue.category(text) == "cancelled"


@pytest.mark.parametrize("text", ["UNKNOWN", "", "SOME_FUTURE_STATE", "garbage|line"])
def test_an_unknown_state_counts_as_pending_never_as_ended(text):
    # Ending on a state we cannot read could let a second launch write the same checkpoints.
    assert queue.category(text) == queue.UNKNOWN_CATEGORY == "pending"
    assert queue.alive(text) and not queue.succeeded(text)


def test_parse_sacct_normalizes_the_state():
    sa = queue.parse_sacct("5|CANCELLED by 1000|0:0|n1|\n6|REQUEUE_HOLD|0:0|n1|\n")
    assert sa["5"]["state"] == "CANCELLED" and queue.alive(sa["6"]["state"])


def test_process_alive(monkeypatch):
    assert queue.process_alive(os.getpid())
    proc = subprocess.Popen(["true"])
    proc.wait()  # reaped: the pid no longer exists
    assert not queue.process_alive(proc.pid)
    assert not queue.process_alive("not-a-pid")

    def denied(pid, sig):
        raise PermissionError(1, "Operation not permitted")  # the process exists, owned by another user

    monkeypatch.setattr(queue.os, "kill", denied)
    assert queue.process_alive(12345)
    assert queue.live_state("12345", "local") == "RUNNING"


def test_a_zombie_is_no_live_process_and_no_upstream_to_wait_for(tmp_path):
    """A job shell that ended but was not reaped yet (its launcher busy) is a zombie: kill(pid, 0) still
    succeeds on it. It is no live job: a downstream stage waiting for it fails at once (afterok), instead of
    waiting out its upstream timeout (an hour on the local executor)."""
    from orchestrator.stages.upstream import Upstream, wait_for

    child = subprocess.Popen(["true"])  # not reaped until the end of the test
    try:
        wait_until(lambda: (queue.proc_stat(child.pid) or ("?",))[0] == "Z", "the child to end unreaped")
        assert not queue.process_alive(child.pid)
        assert not queue.local_job_alive(child.pid)
        up = Upstream(str(tmp_path), str(child.pid), "local")
        with pytest.raises(RuntimeError, match=rf"upstream job {child.pid} ended without completing"):
            wait_for([up], timeout_s=NEVER_S)
    finally:
        child.wait()


def test_a_local_job_waiting_for_its_upstream_is_pending_with_slurms_reason(tmp_path):
    """The job's record names the local jobs its callable waits for (submit.py): while an afterok one has
    not completed, or an afterany one has not ended, the job is PENDING (Dependency), as Slurm shows it."""
    from orchestrator.readback.status import job_state

    upstream = subprocess.Popen(["sleep", "600"])
    try:
        up = tmp_path / "up"
        up.mkdir()
        waits = {"job_id": str(upstream.pid), "state_dir": str(up), "after_any": False}
        entry = {"job_id": str(os.getpid()), "executor": "local", "state_dir": str(tmp_path / "me"),
                 "waits_for": [waits]}  # this process plays the waiting job
        assert job_state(entry, {}, {}, {}) == ("PENDING", "Dependency")
        (up / COMPLETE).write_text(json.dumps({"job": "1"}))  # another job's outcome does not count
        assert queue.local_state(entry) == "PENDING"
        (up / COMPLETE).write_text(json.dumps({"job": str(upstream.pid)}))
        assert job_state(entry, {}, {}, {}) == ("RUNNING", "")
        (up / COMPLETE).unlink()
        entry["waits_for"] = [{**waits, "after_any": True}]  # afterany: until it ended, however
        assert queue.local_state(entry) == "PENDING"
        upstream.kill()
        upstream.wait()
        assert queue.local_state(entry) == "RUNNING"
        assert queue.local_state({**entry, "waits_for": []}) == "RUNNING"
    finally:
        upstream.kill()
        upstream.wait()


def test_a_local_job_whose_task_was_killed_is_failed_not_ended(monkeypatch, tmp_path):
    """No task left a result (killed by a signal, or ended by its hang watchdog's os._exit) and no marker:
    the controller's record of its last attempt still says it failed (ENDED is for a job nobody saw end)."""
    entry = {"job_id": "7", "folder": str(tmp_path), "state_dir": str(tmp_path)}
    monkeypatch.setattr(queue, "local_job_alive", lambda pid, folder: False)
    exits = tmp_path / LOCAL_EXITS.format(job=7)
    lines = [{"attempt": 0, "task": 1, "code": -9}, {"attempt": 1, "task": 0, "code": 0}]
    exits.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert queue.local_state(entry) == "ENDED"  # the last attempt's tasks ended well (a lost marker)
    exits.write_text(exits.read_text() + json.dumps({"attempt": 1, "task": 1, "code": 70}) + "\n")
    assert queue.local_state(entry) == "FAILED"


def test_local_state_of_a_live_process_owned_by_someone_else(monkeypatch, tmp_path):
    entry = {"job_id": "1", "folder": str(tmp_path), "state_dir": str(tmp_path)}  # no results, no markers
    monkeypatch.setattr(queue, "local_job_alive", lambda pid, folder: True)
    assert queue.local_state(entry) == "RUNNING"
    monkeypatch.setattr(queue, "local_job_alive", lambda pid, folder: False)
    assert queue.local_state(entry) == "ENDED"
    assert queue.category("ENDED") == "failed"


def _fake_squeue(tmp_path: Path, monkeypatch, state: str, rc: int = 0) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "squeue").write_text(f"#!/bin/sh\necho '{state}'\nexit {rc}\n")
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.parametrize("state,live", [("SUSPENDED", True), ("REQUEUE_HOLD", True), ("COMPLETED", False),
                                        ("NODE_FAIL", False)])
def test_live_state_from_squeue(tmp_path, monkeypatch, state, live):
    _fake_squeue(tmp_path, monkeypatch, state)
    assert queue.live_state("42", "slurm") == (state if live else None)


def test_live_state_when_squeue_does_not_know_the_job(tmp_path, monkeypatch):
    _fake_squeue(tmp_path, monkeypatch, "slurm_load_jobs error: Invalid job id specified", rc=1)
    assert queue.live_state("42", "slurm") is None


@pytest.mark.parametrize("held", ["SUSPENDED", "REQUEUE_HOLD", "STOPPED", "SPECIAL_EXIT", "UNKNOWN"])
def test_wait_does_not_end_while_a_job_is_suspended_or_held(monkeypatch, held):
    looks = iter([held, held, "COMPLETED"])  # one stage, so nothing else keeps the wait going
    seen = []

    def collect(run_dir):
        seen.append(next(looks))
        return [SimpleNamespace(stage="train", state=seen[-1], job_id="1", loss=None, reason="", failure="")]

    monkeypatch.setattr("orchestrator.readback.status.collect", collect)
    monkeypatch.setattr(flow.time, "sleep", lambda s: None)
    plan = SimpleNamespace(run_dir="unused")
    assert flow.wait(plan, poll_s=0, out=io.StringIO()) is True
    assert len(seen) == 3  # it kept looking while the job was held


def test_wait_reports_a_failed_run(monkeypatch):
    monkeypatch.setattr("orchestrator.readback.status.collect", lambda run_dir: [
        SimpleNamespace(stage="train", state="CANCELLED by 0", job_id="1", loss=None, reason="", failure="")])
    assert flow.wait(SimpleNamespace(run_dir="unused"), poll_s=0, out=io.StringIO()) is False
