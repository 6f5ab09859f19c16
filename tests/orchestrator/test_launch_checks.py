"""Launch-time checks without a cluster: a corrupt cached dataset is a plan problem, and the launch lock plus
the writer record keep a second launch from writing a run's checkpoint directory while a job of it lives.

The same cases on the devcluster (real jobs, real launch.py) are in test_fault_matrix.py (cases 6 and 8).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from orchestrator.launch_checks import WRITER, record_writer, reused_data_problems, single_writer
from orchestrator.launcher import gather_facts, launch
from orchestrator.plan import make_plan
from orchestrator.validate import PlanError
from tests.orchestrator.conftest import compose_cfg
from trainer.data.indexed_dataset import IndexedDatasetBuilder


def _plan(tmp_path: Path, *extra: str):
    cfg = compose_cfg(["+experiment=codeparrot_smoke", f"runs_root={tmp_path}/runs",
                       f"cache_dir={tmp_path}/c", "run_id=r1", "dry_run=true", *extra])
    return cfg, make_plan(cfg, gather_facts(cfg))


def _complete_dataset(plan) -> Path:
    """A valid .bin/.idx pair where the plan's preprocessing stage would find it complete."""
    prep = plan.stage("preprocess")
    Path(prep.state_dir).mkdir(parents=True)
    prefix = f"{prep.job.prefixes[0]}_content_document"
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for n in (5, 7, 3):
        builder.add_document(np.arange(n, dtype=np.uint16))
    builder.finalize(prefix + ".idx")
    (Path(prep.state_dir) / "_COMPLETE").write_text("{}")
    return Path(prefix)


def test_truncated_cached_bin_is_a_plan_problem_naming_the_file(tmp_path):
    cfg, plan = _plan(tmp_path)
    prefix = _complete_dataset(plan)
    assert reused_data_problems(plan) == []
    with open(f"{prefix}.bin", "r+b") as f:
        f.truncate(20)
    problems = reused_data_problems(plan)
    assert [p.code for p in problems] == ["data_corrupt"]
    assert f"{prefix}.bin: 20 bytes, but {prefix}.idx describes 30 bytes" in problems[0].message
    out = io.StringIO()
    launch(cfg, out=out)  # the dry run lists it
    assert "[data_corrupt]" in out.getvalue() and "nothing would be submitted" in out.getvalue()


def test_malformed_cached_idx_is_a_plan_problem(tmp_path):
    _, plan = _plan(tmp_path)
    prefix = _complete_dataset(plan)
    idx = Path(f"{prefix}.idx")
    idx.write_bytes(idx.read_bytes()[:-8])
    (problem,) = reused_data_problems(plan)
    assert f"{idx}: " in problem.message and "truncated or corrupt" in problem.message
    assert f"rm -r {plan.stage('preprocess').state_dir}" in problem.fix


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
            time.sleep(0.5)
            record_writer(plan, str(os.getpid()), "local")  # "submitted": a live job writes the checkpoints
            events.append(("first done", time.monotonic()))

    t = threading.Thread(target=first)
    t.start()
    inside.wait(10)
    with pytest.raises(PlanError) as err:
        with single_writer(plan):
            pass
    events.append(("second refused", time.monotonic()))
    t.join()
    assert [e[0] for e in sorted(events, key=lambda e: e[1])] == ["first done", "second refused"]
    ckpt = Path(plan.stage("train").job.trainer_config["checkpoint"]["dir"])
    assert json.loads((ckpt / WRITER).read_text())["job_id"] == str(os.getpid())
    assert str(ckpt) in str(err.value)
