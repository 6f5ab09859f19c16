"""Test-only hooks (trainer/testing_hooks.py, the one list) are refused by the plan unless testing=true:
in the config, in cluster.env and in the environment launch.py runs in (Slurm passes it to the job)."""

from __future__ import annotations

import io

import pytest

from orchestrator.flow import launch
from orchestrator.plan import PlanInputs, make_plan
from orchestrator.validate import PlanError
from tests.orchestrator.conftest import compose_cfg
from trainer import testing_hooks

SMOKE = ["+experiment=codeparrot_smoke"]
CONFIG_VALUES = {"fail_train": "start", "stall_train": "3"}


def _hook_problems(overrides: list[str], environ: dict[str, str] | None = None) -> list:
    cfg = compose_cfg(SMOKE + overrides)
    plan = make_plan(cfg, PlanInputs("r0", "/tmp/never-created/r0", environ=environ or {}))
    return [p for p in plan.problems if p.code == "test_hook"]


def test_every_config_hook_has_a_value_here():
    assert set(CONFIG_VALUES) == set(testing_hooks.CONFIG_HOOKS)


@pytest.mark.parametrize("name", sorted(testing_hooks.CONFIG_HOOKS))
def test_config_hook_is_refused_without_the_switch(name):
    hits = _hook_problems([f"{name}={CONFIG_VALUES[name]}"])
    assert [p.key for p in hits] == [name] and "testing=true" in hits[0].fix
    assert str(CONFIG_VALUES[name]) in str(hits[0])
    assert _hook_problems([f"{name}={CONFIG_VALUES[name]}", "testing=true"]) == []


@pytest.mark.parametrize("name", sorted(testing_hooks.ENV_HOOKS))
def test_env_hook_is_refused_in_cluster_env_and_the_environment(name):
    hits = _hook_problems([f"+cluster.env.{name}=x@1"])
    assert [p.key for p in hits] == [f"cluster.env.{name}"], hits
    hits = _hook_problems([], {name: "x@1", "HOME": "/root"})
    assert [p.key for p in hits] == [f"environment variable {name}"] and f"unset {name}" in hits[0].fix
    assert _hook_problems([f"+cluster.env.{name}=x@1", "testing=true"], {name: "x@1"}) == []
    assert _hook_problems([], {name: ""}) == []  # set but empty: inert


def test_launch_reads_the_launching_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(testing_hooks.NODE_NAME, "n7")
    result = launch(compose_cfg(SMOKE + [f"runs_root={tmp_path}", "dry_run=true"]), out=io.StringIO())
    assert "[test_hook] environment variable SLIPWAY_NODE_NAME='n7'" in result.text
    monkeypatch.delenv(testing_hooks.NODE_NAME)
    with pytest.raises(PlanError, match=r"\[test_hook\] fail_train='start'"):
        launch(compose_cfg(SMOKE + [f"runs_root={tmp_path}", "fail_train=start"]), out=io.StringIO())
    assert not any(tmp_path.iterdir())  # refused before anything was written
