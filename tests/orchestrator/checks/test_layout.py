"""The interleaved schedule's constraints (parallel.virtual_pp_size) are refused at plan time, all at
once, each with its key, value and fix (orchestrator/checks/layout.py), and an intended layout passes."""

from __future__ import annotations

from orchestrator.base.plan_types import Context
from orchestrator.checks import run_checks
from tests.orchestrator.conftest import compose_cfg

SMOKE = ["+experiment=codeparrot_smoke"]  # 4 layers, tp=2 pp=2 on 4 ranks: dp=1, 16/8 = 2 micro-batches


def _problems(overrides: list[str]) -> dict[str, object]:
    ctx = Context(compose_cfg(SMOKE + overrides), exists=lambda p: True)
    return {p.code: p for p in run_checks(ctx, at="plan")}


def test_interleaved_layout_validates():
    assert _problems(["parallel.virtual_pp_size=2"]) == {}  # 4 layers = 2·2 chunks, 2 micro-batches


def test_layers_and_microbatches_are_refused_together():
    found = _problems(["parallel.virtual_pp_size=3", "train.micro_batch_size=4",
                       "train.global_batch_size=12"])
    layers, batch = found["vpp_layers"], found["vpp_microbatches"]
    assert (layers.key, layers.value) == ("parallel.virtual_pp_size", 3)
    assert "num_layers=4" in layers.message and "2·3 = 6" in layers.message
    assert "virtual_pp_size=2" in layers.fix
    assert (batch.key, batch.value) == ("train.global_batch_size", 12)
    assert "3 micro-batches" in batch.message and "e.g. 8" in batch.fix


def test_interleaving_needs_a_pipeline():
    found = _problems(["parallel.virtual_pp_size=2", "parallel.pp_size=1", "cluster.tasks_per_node=2"])
    assert found["virtual_pp"].key == "parallel.virtual_pp_size"
    assert "pp_size>=2" in found["virtual_pp"].fix
