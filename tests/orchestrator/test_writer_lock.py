"""The launch lock and the writer record (orchestrator/record/writer_lock.py) keep a second launch from
writing a run's checkpoint directory while a job of it lives.

The same cases on the devcluster (real jobs, real launch.py) are in test_fault_matrix.py (case 8).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from orchestrator.base.problems import PlanError
from orchestrator.record.writer_lock import record_writer, single_writer
from tests.orchestrator.conftest import dry_plan as _plan
from tests.waits import NEVER_S
from trainer.run_files import CKPT_WRITER


def _ended_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_live_job_of_the_run_refuses_the_launch_an_ended_one_does_not(tmp_path):
    _, plan = _plan(tmp_path, "cluster=local")
    run = Path(plan.run_dir)
    run.mkdir(parents=True)
    jobs = {"train": [{"job_id": str(os.getpid()), "executor": "local"}]}  # this process: alive
    (run / "run.json").write_text(json.dumps({"jobs": jobs}))
    with pytest.raises(PlanError) as err:
        with single_writer(plan):
            pass
    assert f"train job {os.getpid()} (RUNNING)" in str(err.value) and "[run_active]" in str(err.value)
    jobs["train"][0]["job_id"] = str(_ended_pid())
    (run / "run.json").write_text(json.dumps({"jobs": jobs}))
    with single_writer(plan):
        pass


def test_concurrent_launches_of_one_run_let_exactly_one_through(tmp_path):
    """The second launcher waits on the lock while the first records its job, then sees it and refuses."""
    _, plan = _plan(tmp_path, "cluster=local")
    inside, events = threading.Event(), []

    def first() -> None:
        with single_writer(plan):
            inside.set()
            # Give the second launcher time to reach the lock. Not a race: whether it waits there or
            # arrives after the release, the lock order makes it see the recorded job and refuse.
            time.sleep(0.5)
            record_writer(plan, str(os.getpid()), "local")  # "submitted": a live job writes the checkpoints
            events.append(("first done", time.monotonic()))

    t = threading.Thread(target=first)
    t.start()
    assert inside.wait(NEVER_S)
    with pytest.raises(PlanError) as err:
        with single_writer(plan):
            pass
    events.append(("second refused", time.monotonic()))
    t.join()
    assert [e[0] for e in sorted(events, key=lambda e: e[1])] == ["first done", "second refused"]
    ckpt = Path(plan.stage("train").job.trainer_config["checkpoint"]["dir"])
    assert json.loads((ckpt / CKPT_WRITER).read_text())["job_id"] == str(os.getpid())
    assert str(ckpt) in str(err.value)
