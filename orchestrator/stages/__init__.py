"""The stages of a run, one module each (corpus, preprocess, train, convert, eval: see base.py for what a
stage is made of). The list is found, not written down: every module of this package that defines
``STAGE`` is a stage, and :data:`STAGES` orders them so that each comes after the stages it names in
``after``. Plan, render, submit and status iterate over it; a new stage is a new module here (or, from
outside, :func:`register`).

The node callables and job specs are importable from here under the names that pickles of runs
submitted before the stages became modules use (``orchestrator.stages.TrainStage``...).
"""

from __future__ import annotations

import importlib
import pkgutil

from orchestrator.base.plan_types import StagePlan
from orchestrator.stages.base import NodeStage, StageDef
from orchestrator.stages.convert import ConvertJob, ConvertStage
from orchestrator.stages.corpus import CorpusStage
from orchestrator.stages.eval import EvalStage
from orchestrator.stages.preprocess import PreprocessStage
from orchestrator.stages.train import TrainJob, TrainStage
from orchestrator.stages.upstream import Upstream
from trainer.run_files import COMPLETE, FAILED

__all__ = ["COMPLETE", "FAILED", "STAGES", "ConvertJob", "ConvertStage", "CorpusStage",
           "EvalStage", "NodeStage", "PreprocessStage", "StageDef", "StagePlan", "TrainJob", "TrainStage",
           "Upstream", "get", "register", "unregister"]


def ordered(stages: list[StageDef]) -> list[StageDef]:
    """Each stage after every stage it names in ``after`` (that exists); otherwise in the given order."""
    names = {s.name for s in stages}
    out: list[StageDef] = []
    done: set[str] = set()
    todo = list(stages)
    while todo:
        ready = next((s for s in todo if all(a in done or a not in names for a in s.after)), None)
        if ready is None:
            cycle = ", ".join(f"{s.name} after {'/'.join(s.after)}" for s in todo)
            raise ValueError(f"the stages' `after` lists form a cycle: {cycle}")
        out.append(ready)
        done.add(ready.name)
        todo.remove(ready)
    return out


def _discover() -> list[StageDef]:
    found = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        stage = getattr(module, "STAGE", None)
        if isinstance(stage, StageDef):
            found.append(stage)
    return ordered(found)


STAGES: list[StageDef] = _discover()


def get(name: str) -> StageDef | None:
    """The stage called ``name`` (None for one this version does not know, e.g. in an old run's record)."""
    return next((s for s in STAGES if s.name == name), None)


def register(stage: StageDef) -> None:
    """Add a stage defined outside this package (a plugin, or a test's); it joins the order by ``after``."""
    if get(stage.name) is not None:
        raise ValueError(f"a stage named {stage.name!r} exists already")
    STAGES[:] = ordered([*STAGES, stage])


def unregister(name: str) -> None:
    STAGES[:] = [s for s in STAGES if s.name != name]
