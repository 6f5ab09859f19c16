"""Test-only hooks (trainer/faults.py, the one list) are refused by the plan unless the switch
SLIPWAY_TESTING=1 is on where launch.py runs: in cluster.env and in that environment (Slurm passes it to
the job). They are never configuration keys, and without the switch a job does not load them."""

from __future__ import annotations

import dataclasses
import io

import pytest

from orchestrator.base.problems import PlanError
from orchestrator.launch.flow import launch
from orchestrator.planning.plan import PlanInputs, make_plan
from tests.orchestrator.conftest import compose_cfg
from tests.seam import hook_env
from trainer import faults

SMOKE = ["+experiment=codeparrot_smoke"]
ON = hook_env()  # the switch, and the plugin a job loads under it


def _hook_problems(overrides: list[str], environ: dict[str, str] | None = None) -> list:
    cfg = compose_cfg(SMOKE + overrides)
    plan = make_plan(cfg, PlanInputs("r0", "/tmp/never-created/r0", environ=environ or {}))
    return [p for p in plan.problems if p.code == "test_hook"]


def test_the_public_config_has_no_test_keys():
    from orchestrator.base.schema import SlipwayConfig

    fields = {f.name for f in dataclasses.fields(SlipwayConfig)}
    assert not fields & {"testing", "fail_train", "stall_train"}, fields


@pytest.mark.parametrize("name", sorted(faults.ENV_HOOKS))
def test_env_hook_is_refused_in_cluster_env_and_the_environment(name):
    hits = _hook_problems([f"+cluster.env.{name}=x@1"])
    assert [p.key for p in hits] == [f"cluster.env.{name}"], hits
    hits = _hook_problems([], {name: "x@1", "HOME": "/root"})
    assert [p.key for p in hits] == [f"environment variable {name}"] and f"unset {name}" in hits[0].fix
    assert _hook_problems([f"+cluster.env.{name}=x@1"], {name: "x@1", **ON}) == []
    assert _hook_problems([], {name: ""}) == []  # set but empty: inert


def test_launch_reads_the_launching_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.NODE_NAME, "n7")
    result = launch(compose_cfg(SMOKE + [f"runs_root={tmp_path}", "dry_run=true"]), out=io.StringIO())
    assert "[test_hook] environment variable SLIPWAY_NODE_NAME='n7'" in result.text
    monkeypatch.delenv(faults.NODE_NAME)
    monkeypatch.setenv(faults.FAIL_TRAIN, "start")
    with pytest.raises(PlanError, match=r"\[test_hook\] environment variable SLIPWAY_FAIL_TRAIN='start'.*"
                                        r"SLIPWAY_TESTING=1"):
        launch(compose_cfg(SMOKE + [f"runs_root={tmp_path}"]), out=io.StringIO())
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_without_the_switch_a_job_loads_no_hook():
    """A stray hook that reached a job anyway (set after the launch) changes nothing there: no plugin is
    loaded without the switch, even one named, and the kernels stay as resolved."""
    from trainer.ops import resolve

    kernels = resolve("eager", "cpu")
    stray = {faults.KERNEL_FAULT: "all", faults.FAIL_TRAIN: "start", faults.PLUGIN: "tests.seam"}
    assert faults.plugin(stray) is None and faults.with_faults(kernels, stray) is kernels
    assert faults.with_faults(kernels, {**stray, **ON}).names["layer_norm"].endswith("+fault")
