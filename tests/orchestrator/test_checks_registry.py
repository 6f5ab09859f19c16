"""The checks are one registry grouped by subject (orchestrator/checks/): every check is registered with a
subject and a cost, lives in its subject's module, and no check function lives anywhere else; a config
with problems of several subjects gets all of them from one launch."""

from __future__ import annotations

import ast
import io
import pathlib

import pytest

from orchestrator.base.plan_types import Context
from orchestrator.base.problems import PlanError
from orchestrator.checks import CHECKS, COSTS, SUBJECTS
from orchestrator.launch.flow import launch
from tests.orchestrator.conftest import REPO, compose_cfg

FIXED_SUBJECTS = ("run", "data", "tokenizer", "layout", "memory", "container", "cluster", "slurm", "secrets",
                  "checkpoints")
FIXED_COSTS = ("pure", "inputs", "world")
PACKAGE = REPO / "orchestrator" / "checks"


def test_every_check_has_a_known_subject_and_cost_and_lives_in_its_subjects_module():
    assert SUBJECTS == FIXED_SUBJECTS and COSTS == FIXED_COSTS
    for check in CHECKS:
        name = f"{check.fn.__module__}.{check.fn.__name__}"
        assert check.subject in FIXED_SUBJECTS, name
        assert check.cost in FIXED_COSTS, name
        assert check.fn.__module__ == f"orchestrator.checks.{check.subject}", name
    assert len({c.fn for c in CHECKS}) == len(CHECKS)  # registered once
    assert {c.subject for c in CHECKS} == set(FIXED_SUBJECTS)  # no empty subject
    assert {f"{p.stem}" for p in PACKAGE.glob("*.py")} == {*FIXED_SUBJECTS, "__init__"}


def _no_file(path: str) -> bool:
    raise AssertionError(f"a check tagged pure asked whether {path} exists")


def test_pure_checks_read_no_file_and_plan_checks_need_no_plan():
    """The tags say what a check reads: a pure check never asks ``exists`` (a plan test could not tell it
    from a config rule), and every check run at plan time runs without the plan; a check run at launch
    that reads the world gets it."""
    cfg = compose_cfg(["+experiment=codeparrot_smoke", "data.corpus=null", "data.paths=[/nope.jsonl]",
                       "tokenizer.vocab_file=/nope/vocab.json", "tokenizer.merge_file=/nope/merges.txt"])
    for check in CHECKS:
        if check.cost == "pure":
            check.fn(Context(cfg, exists=_no_file))
        if check.at == "plan":
            check.fn(Context(cfg, exists=lambda p: False))  # no plan: require_plan() would raise
    asked = []
    for check in CHECKS:
        if check.cost == "inputs" and check.at == "plan":
            check.fn(Context(cfg, exists=lambda p: asked.append(p) or False))
    assert "/nope.jsonl" in asked and "/nope/vocab.json" in asked  # the file checks are tagged inputs


def _functions(path: pathlib.Path) -> list[ast.FunctionDef]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]


def _is_check(fn: ast.FunctionDef) -> bool:
    """A function that returns problems: annotated ``list[Problem]``, or named ``*_problems`` without an
    annotation that says otherwise. The config sections' own ``problems()`` methods stay with their fields
    (trainer/config, orchestrator/base/schema) and return ConfigIssue records."""
    returns = ast.unparse(fn.returns) if fn.returns else None
    if returns is not None and "list[Problem]" in returns.replace("'", "").replace('"', ""):
        return True
    return fn.name.endswith("_problems") and returns is None


# The record's own module: it orders the problems the checks found (problems.arrange), it checks nothing.
RECORD = pathlib.Path("orchestrator/base/problems.py")


def checks_outside(root: pathlib.Path) -> list[str]:
    return [f"{path.relative_to(root)}:{fn.lineno} {fn.name}"
            for path in sorted((root / "orchestrator").rglob("*.py"))
            if PACKAGE.relative_to(REPO) not in path.relative_to(root).parents
            and path.relative_to(root) != RECORD
            for fn in _functions(path) if _is_check(fn)]


def test_no_check_function_lives_outside_the_checks_package():
    assert checks_outside(REPO) == []


def test_the_scan_sees_a_check_outside(tmp_path):
    (tmp_path / "orchestrator" / "checks").mkdir(parents=True)
    (tmp_path / "orchestrator" / "planning").mkdir()
    (tmp_path / "orchestrator" / "planning" / "plan.py").write_text(
        "def _estimate_problems(cfg) -> list[Problem]:\n    return []\n\n"
        "def rank_problems(rows) -> list[str]:\n    return []\n\n"
        "def names_problems(cfg):\n    return []\n")
    assert checks_outside(tmp_path) == ["orchestrator/planning/plan.py:1 _estimate_problems",
                                        "orchestrator/planning/plan.py:7 names_problems"]


def test_every_public_check_in_the_package_is_registered():
    registered = {(c.fn.__module__.rpartition(".")[2], c.fn.__name__) for c in CHECKS}
    found = {(path.stem, fn.name) for path in PACKAGE.glob("*.py") for fn in _functions(path)
             if fn.name.endswith("_problems") and not fn.name.startswith("_")}
    assert found == registered


def test_problems_of_several_subjects_are_reported_by_one_launch(tmp_path):
    """Pure, input-reading and world-reading checks of eight subjects, all in one refusal."""
    (tmp_path / "d").mkdir()  # data.paths names a folder: the inputs check reads it
    ck = tmp_path / "ck"  # a checkpoint directory of which nothing verifies: the world check reads it
    (ck / "iter_0000010").mkdir(parents=True)
    (ck / "iter_0000010" / "junk").write_text("x")
    (ck / "latest_checkpointed_iteration.txt").write_text("10")
    cfg = compose_cfg([
        "+experiment=codeparrot_smoke", "data=codeparrot", f"runs_root={tmp_path}/runs",
        f"cache_dir={tmp_path}/cache", f"data.paths=[{tmp_path}/d]", f"checkpoint.dir={ck}",
        f"tokenizer.vocab_file={tmp_path}/no/vocab.json", f"tokenizer.merge_file={tmp_path}/no/merges.txt",
        "parallel.tp_size=3", "train.precision=fp16", "optim.warmup_iters=100000",
        "container=apptainer_ngc", "container.image=null", "+cluster.env.DB_PASSWD=hunter22-secret"])
    with pytest.raises(PlanError) as err:
        launch(cfg, out=io.StringIO())
    got = [(p.code, p.key) for p in err.value.problems]
    assert got == [
        ("tp_heads", "parallel.tp_size"),  # layout, pure
        ("warmup", "optim.warmup_iters"),  # run, pure
        ("precision", "train.precision"),  # cluster, pure
        ("container_image", "container.image"),  # container, pure
        ("file_missing", "tokenizer.vocab_file"),  # tokenizer, pure (asks exists)
        ("file_missing", "tokenizer.merge_file"),
        ("secret_in_config", "cluster.env.DB_PASSWD"),  # secrets, pure
        ("data_is_dir", "data.paths"),  # data, inputs
        ("checkpoint_damaged", "checkpoint.dir"),  # checkpoints, world
    ]
    assert "hunter22" not in str(err.value)
    assert not (tmp_path / "runs").exists()
