"""The plan's shared types: what the planner makes (:class:`Plan`, a :class:`StagePlan` per stage, each
stage's :class:`JobResources`) and what a check looks at (:class:`Context`). The stages, the checks, the
planner, the submitter and the status all read them, so they sit below all of those and import only the
config layer."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from orchestrator.base.estimate import MemoryEstimate, MemoryOption, TimeEstimate
from orchestrator.base.facts import SweepInfo
from orchestrator.base.layout import Layout, layout_of
from orchestrator.base.problems import Problem
from orchestrator.base.schema import SlipwayConfig


@dataclass(frozen=True)
class JobResources:
    """What one stage asks the scheduler for (each stage's ``resources``: orchestrator/stages/)."""

    name: str
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    time_limit_min: int = 60
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    mem: str | None = None
    exclusive: bool = False
    constraint: str | None = None
    extra: tuple[tuple[str, str], ...] = ()
    signal_delay_s: int | None = None  # training only: --signal=USR2@lead and the requeue logic
    max_retries: int = 0
    max_timeouts: int = 0
    array: str | None = None  # a job array, sbatch --array (e.g. "0-3%1"); its logs are named %A_%a


@dataclass(frozen=True)
class StagePlan:
    name: str  # a StageDef's name
    key: str
    state_dir: str  # where _COMPLETE/_FAILED/_JOB.json go (the output dir for shared stages)
    shared: bool  # output reusable across runs (content-addressed, in the cache)
    depends_on: tuple[str, ...]
    job: Any  # the stage's job spec, pickled into its node callable
    # Slurm: a job array of this many elements, that many at once (the node callable's array_task(i) is
    # element i); the local executor runs the stage's callable once.
    array: tuple[int, int] | None = None
    # Of depends_on, those this stage waits for to end, whatever their outcome (afterany), not to succeed.
    after_any: tuple[str, ...] = ()


@dataclass
class Plan:
    run_id: str
    run_dir: str
    experiment: str
    layout: Layout
    vocab_size: int
    memory: MemoryEstimate
    time: TimeEstimate
    stages: list[StagePlan]
    problems: list[Problem]
    sweep: SweepInfo | None = None
    warnings: list[str] = field(default_factory=list)  # said before submitting; nothing is refused
    memory_options: list[MemoryOption] = field(default_factory=list)  # memory_options()
    # The config the plan is for: the one given, or with layout=auto its first choice applied (what the
    # launch prints, records and submits); the search itself beside it (an autolayout.Proposal: typed Any,
    # as autolayout plans with the checks, which read these types).
    config: SlipwayConfig | None = None
    proposal: Any = None
    wandb_key: str | None = None  # where the W&B API key comes from (trainer.wandb_key.key_source), never it

    def stage(self, name: str) -> StagePlan:
        return next(s for s in self.stages if s.name == name)


@dataclass(frozen=True)
class Estimates:
    """The plan's per-device memory and step-time estimates, and the memory options it weighed."""

    memory: MemoryEstimate
    time: TimeEstimate
    memory_options: list[MemoryOption]
    # When nothing fits: the fewest GPUs (tp, pp) one model replica fits on with every memory saver
    # (orchestrator.planning.plan.smallest_replica); None when no split fits either or it was not needed.
    smallest_replica: tuple[int, int] | None = None


@dataclass(frozen=True)
class Context:
    """What a check may look at. make_plan fills the first four (``estimates`` only where the layout gives
    one) and, for layout=auto, ``proposal``; launch() passes the plan to the checks that read the world
    (the directories they read are the plan's)."""

    cfg: SlipwayConfig
    environ: Mapping[str, str] = field(default_factory=dict)  # the launching environment
    exists: Callable[[str], bool] = os.path.exists  # plan tests answer it themselves
    estimates: Estimates | None = None
    plan: Plan | None = None
    proposal: Any = None  # layout=auto: the plan's search (an autolayout.Proposal)

    @cached_property
    def layout(self) -> Layout:
        return layout_of(self.cfg)

    def require_plan(self) -> Plan:
        if self.plan is None:
            raise ValueError("a world check reads the plan's directories: pass Context(..., plan=plan)")
        return self.plan
