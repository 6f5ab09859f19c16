"""A stage's name is written once, in its module of orchestrator/stages/: the rest of the orchestrator
iterates over the stage list or imports the name, never spells it (an ``if stage == "train"`` branch is
the stage's own code living somewhere else)."""

from __future__ import annotations

import ast
from pathlib import Path

from orchestrator.stages import STAGES
from tests.orchestrator.conftest import REPO

# The same words meaning something else: a config section, a chart's legend.
NOT_STAGES = {("orchestrator/planning/plan.py", "train"): 1,  # MEMORY_OPTIONS: the train config section
              ("orchestrator/readback/summary.py", "train"): 1,  # the loss chart's "train" curve
              ("orchestrator/planning/autolayout.py", "train"): 3,  # a layout's fields of the train section
              ("orchestrator/base/schema.py", "tune"): 1,  # the launch switch tune=true|force, its choice
              ("orchestrator/checks/layout.py", "tune"): 1}  # the same key, in its problem


def spelled(names: set[str], root: Path = REPO) -> dict[tuple[str, str], int]:
    """(file, name) → how many string literals equal to a stage name, outside orchestrator/stages/."""
    found: dict[tuple[str, str], int] = {}
    for path in [*sorted((root / "orchestrator").rglob("*.py")), root / "launch.py"]:
        rel = path.relative_to(root).as_posix()
        if rel.startswith("orchestrator/stages/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in names:
                found[(rel, node.value)] = found.get((rel, node.value), 0) + 1
    return found


def test_stage_names_are_spelled_only_in_their_modules():
    assert spelled({s.name for s in STAGES}) == NOT_STAGES


def test_the_scan_sees_a_spelled_stage_name(tmp_path):
    (tmp_path / "orchestrator" / "stages").mkdir(parents=True)
    (tmp_path / "launch.py").write_text("")
    (tmp_path / "orchestrator" / "readback").mkdir()
    status = 'def f(stage):\n    return stage == "eval"\n'
    (tmp_path / "orchestrator" / "readback" / "status.py").write_text(status)
    (tmp_path / "orchestrator" / "stages" / "eval.py").write_text('NAME = "eval"\n')
    assert spelled({"eval"}, tmp_path) == {("orchestrator/readback/status.py", "eval"): 1}


def test_every_stage_comes_after_the_stages_it_names():
    order = [s.name for s in STAGES]
    assert order == ["corpus", "preprocess", "tune", "train", "convert", "eval"]
    for s in STAGES:
        assert all(order.index(a) < order.index(s.name) for a in s.after if a in order)


def test_a_stage_list_that_cannot_be_ordered_is_refused_by_name():
    import pytest

    from orchestrator.stages import ordered, register
    from orchestrator.stages.base import StageDef

    def stage(name: str, after: tuple[str, ...]) -> StageDef:
        return type(name.title(), (StageDef,), {"name": name, "after": after})()

    with pytest.raises(ValueError, match="a after b, b after a"):
        ordered([stage("a", ("b",)), stage("b", ("a",))])
    late_first = ordered([stage("late", ("early", "gone")), stage("early", ())])  # "gone": not registered
    assert [s.name for s in late_first] == ["early", "late"]
    with pytest.raises(ValueError, match="'train' exists already"):
        register(stage("train", ()))
