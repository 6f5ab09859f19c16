"""The checkpoint checks (orchestrator/checks/checkpoints.py) at plan time, without a cluster: a damaged
latest checkpoint is a warning naming the file and the fallback, a missing or garbage tracker is reported,
and checkpoints of which none verifies refuse the launch."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from orchestrator.base.plan_types import Context
from orchestrator.base.problems import PlanError
from orchestrator.launch.flow import launch
from tests.orchestrator.conftest import dry_plan as _plan


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
