"""A stage's ``_COMPLETE``/``_FAILED`` marker names the job that wrote it, and only that job's marker is
that job's outcome (orchestrator/world/queue.py marker_of). Tested alone: a launch also deletes a
stage's old markers before it submits (launch/submit.py), which would hide a reader that took any marker
for this job's; here the stale marker stays, as it does when that deletion did not happen (a launch killed
between submitting and deleting, a marker written late by a job that was still ending, a copied run).

Each reader of markers is asked with a marker of another job in place: the wait of a local job for its
upstream (Slurm's afterok), the local job state, and status's failure reason."""

from __future__ import annotations

import subprocess
import sys

import pytest

from orchestrator.readback.status import _failure
from orchestrator.stages.base import mark
from orchestrator.stages.upstream import Upstream, wait_for
from orchestrator.world import queue
from trainer.run_files import COMPLETE, FAILED

OLD_JOB = "111"


@pytest.fixture
def gone_pid() -> str:
    """The pid of a process that has ended and been reaped: this job's controller, gone."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return str(proc.pid)


def test_marker_of_answers_only_for_the_job_it_names(tmp_path):
    mark(str(tmp_path), COMPLETE, {"key": "k", "job": OLD_JOB})
    assert queue.marker_of(tmp_path, COMPLETE, "222") is None
    assert queue.marker_of(tmp_path, COMPLETE, OLD_JOB)["job"] == OLD_JOB
    assert queue.marker_of(tmp_path, COMPLETE, None)["key"] == "k"  # a reused output: any job's
    mark(str(tmp_path), COMPLETE, {"key": "k"})  # written before markers named their job
    assert queue.marker_of(tmp_path, COMPLETE, "222") is not None


def test_a_stale_complete_marker_does_not_satisfy_the_wait_of_a_job_that_ended(tmp_path, gone_pid):
    mark(str(tmp_path), COMPLETE, {"key": "k", "job": OLD_JOB})
    with pytest.raises(RuntimeError, match=f"upstream job {gone_pid} ended without completing"):
        wait_for([Upstream(str(tmp_path), gone_pid, "local")], timeout_s=30)


def test_a_stale_failed_marker_is_not_this_jobs_failure(tmp_path, gone_pid):
    mark(str(tmp_path), FAILED, {"key": "k", "job": OLD_JOB, "reason": "ValueError: the old launch's"})
    mark(str(tmp_path), COMPLETE, {"key": "k", "job": gone_pid})
    wait_for([Upstream(str(tmp_path), gone_pid, "local")], timeout_s=30)  # this job completed: no raise
    entry = {"job_id": gone_pid, "executor": "local", "folder": str(tmp_path / "jobs"),
             "state_dir": str(tmp_path)}
    assert queue.local_state(entry) == "COMPLETED"


def test_a_stale_complete_marker_is_not_this_jobs_state(tmp_path, gone_pid):
    mark(str(tmp_path), COMPLETE, {"key": "k", "job": OLD_JOB})
    entry = {"job_id": gone_pid, "executor": "local", "folder": str(tmp_path / "jobs"),
             "state_dir": str(tmp_path)}
    assert queue.local_state(entry) == "ENDED"


def test_status_never_gives_another_jobs_error_as_the_reason(tmp_path):
    mark(str(tmp_path), FAILED, {"key": "k", "job": OLD_JOB, "reason": "ValueError: the old launch's"})
    entry = {"job_id": "222", "executor": "slurm", "state_dir": str(tmp_path)}
    reason = _failure("FAILED", entry, {"exit": "1:0"})
    assert "old launch" not in reason and "exit code 1:0" in reason, reason
    mark(str(tmp_path), FAILED, {"key": "k", "job": "222", "reason": "ValueError: this job's"})
    assert _failure("FAILED", entry, {}) == "ValueError: this job's"
