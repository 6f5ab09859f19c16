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

from orchestrator.checks import Context
from orchestrator.checks.data import reused_data_problems
from orchestrator.flow import gather_facts, launch
from orchestrator.plan import make_plan
from orchestrator.problems import PlanError
from orchestrator.writer_lock import record_writer, single_writer
from tests.orchestrator.conftest import compose_cfg
from tests.waits import NEVER_S
from trainer.data.indexed_dataset import IndexedDatasetBuilder
from trainer.run_files import CKPT_WRITER


def _plan(tmp_path: Path, *extra: str):
    cfg = compose_cfg(["+experiment=codeparrot_smoke", f"runs_root={tmp_path}/runs",
                       f"cache_dir={tmp_path}/c", "run_id=r1", "dry_run=true", *extra])
    return cfg, make_plan(cfg, gather_facts(cfg))


def _complete_dataset(plan) -> Path:
    """A valid .bin/.idx pair where the plan's preprocessing stage would find it complete."""
    prep = plan.stage("preprocess")
    Path(prep.state_dir).mkdir(parents=True)
    prefix = f"{prep.job[0].output_prefix}_content_document"
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for n in (5, 7, 3):
        builder.add_document(np.arange(n, dtype=np.uint16))
    builder.finalize(prefix + ".idx")
    (Path(prep.state_dir) / "_COMPLETE").write_text("{}")
    return Path(prefix)


def test_truncated_cached_bin_is_a_plan_problem_naming_the_file(tmp_path):
    cfg, plan = _plan(tmp_path)
    prefix = _complete_dataset(plan)
    assert reused_data_problems(Context(cfg, plan=plan)) == []
    with open(f"{prefix}.bin", "r+b") as f:
        f.truncate(20)
    problems = reused_data_problems(Context(cfg, plan=plan))
    assert [p.code for p in problems] == ["data_corrupt"]
    assert f"{prefix}.bin: 20 bytes, but {prefix}.idx describes 30 bytes" in problems[0].message
    out = io.StringIO()
    launch(cfg, out=out)  # the dry run lists it
    assert "[data_corrupt]" in out.getvalue() and "nothing would be submitted" in out.getvalue()


def test_malformed_cached_idx_is_a_plan_problem(tmp_path):
    cfg, plan = _plan(tmp_path)
    prefix = _complete_dataset(plan)
    idx = Path(f"{prefix}.idx")
    idx.write_bytes(idx.read_bytes()[:-8])
    (problem,) = reused_data_problems(Context(cfg, plan=plan))
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


def _checkpoints(plan, iterations=(10, 20)) -> Path:
    import torch

    from trainer.checkpoint import protocol as ckpt

    d = Path(plan.stage("train").job.trainer_config["checkpoint"]["dir"])
    for it in iterations:
        ckpt.save_checkpoint(str(d), it, {"w": torch.zeros(500), "iteration": it}, ckpt.ShardLayout(), None)
    return d


def _truncate_shard(d: Path, it: int) -> None:
    shard = d / f"iter_{it:07d}" / "mp_rank_00" / "model_optim_rng.pt"
    shard.write_bytes(shard.read_bytes()[:100])


def test_damaged_latest_checkpoint_is_a_plan_warning_naming_the_file_and_the_fallback(tmp_path):
    cfg, plan = _plan(tmp_path)
    d = _checkpoints(plan)
    _truncate_shard(d, 20)
    err = io.StringIO()
    sys_err, sys.stderr = sys.stderr, err
    try:
        launch(cfg, out=io.StringIO())
    finally:
        sys.stderr = sys_err
    text = err.getvalue()
    assert "warning: checkpoint iteration 20" in text and "iter_0000020/mp_rank_00/model_optim_rng.pt" in text
    assert "the training job will load iteration 10 instead" in text
    assert (d / "iter_0000020").is_dir()  # the plan only looks: the job moves it aside


@pytest.mark.parametrize("tracker", [None, "abc"])
def test_missing_or_garbage_tracker_is_reported_at_plan_time(tmp_path, tracker):
    cfg, plan = _plan(tmp_path)
    d = _checkpoints(plan)
    (d / "latest_checkpointed_iteration.txt").unlink()
    if tracker:
        (d / "latest_checkpointed_iteration.txt").write_text(tracker)
    from orchestrator.checks.checkpoints import checkpoint_problems

    assert checkpoint_problems(Context(cfg, plan=plan)) == []
    assert len(plan.warnings) == 1 and "loading the newest one that verifies" in plan.warnings[0]
    assert ("is missing" if tracker is None else "holds 'abc'") in plan.warnings[0]


def test_checkpoints_of_which_none_verifies_refuse_the_launch(tmp_path):
    cfg, plan = _plan(tmp_path, "dry_run=false")
    d = _checkpoints(plan)
    for it in (10, 20):
        _truncate_shard(d, it)
    with pytest.raises(PlanError) as err:
        launch(cfg, out=io.StringIO())
    problem = next(p for p in err.value.problems if p.code == "checkpoint_damaged")
    assert problem.key == "checkpoint.dir" and "no checkpoint" in problem.message and "restore" in problem.fix
