"""Every configuration check of a launch, grouped by subject and tagged with its cost.

One module per subject: ``run`` (each config section's own rules, warm-up, names), ``data``,
``tokenizer``, ``layout`` (the parallel layout and the batch), ``memory``, ``container`` (pyxis included),
``cluster`` (its devices and time limit), ``secrets`` (secrets, test hooks, the W&B key) and
``checkpoints``. A check is a function ``(Context) -> list[Problem]``; :data:`CHECKS` lists them all,
each with its subject and its cost:

- ``pure``: the config and what :class:`Context` carries with it (the launching environment, the plan's
  estimates, the injected ``exists`` that the file checks ask): :func:`orchestrator.plan.make_plan` runs
  them. (The W&B key check also reads ``$NETRC``/``~/.netrc``, the jobs' own key file, as it always has.)
- ``inputs``: reads the content of the input files (documents, tokenizer files, the container image).
- ``world``: reads the world through the plan: the cache, the run's checkpoints, the queue, ``srun``.

:func:`orchestrator.flow.launch` runs the ``inputs`` and ``world`` checks after the plan, so a launch (or
a dry run) reports every problem at once. A new check goes into its subject's module and one row here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Literal, get_args

from orchestrator.checks import (
    checkpoints,
    cluster,
    container,
    data,
    layout,
    memory,
    run,
    secrets,
    tokenizer,
)
from orchestrator.estimate import MemoryEstimate, MemoryOption, TimeEstimate
from orchestrator.layout import Layout, layout_of
from orchestrator.problems import Problem
from orchestrator.schema import SlipwayConfig

if TYPE_CHECKING:
    from orchestrator.plan import Plan

Subject = Literal["run", "data", "tokenizer", "layout", "memory", "container", "cluster", "secrets",
                  "checkpoints"]
Cost = Literal["pure", "inputs", "world"]
SUBJECTS: tuple[Subject, ...] = get_args(Subject)
COSTS: tuple[Cost, ...] = get_args(Cost)


@dataclass(frozen=True)
class Estimates:
    """The plan's per-device memory and step-time estimates, and the memory options it weighed."""

    memory: MemoryEstimate
    time: TimeEstimate
    memory_options: list[MemoryOption]


@dataclass(frozen=True)
class Context:
    """What a check may look at. make_plan fills the first four (``estimates`` only where the layout gives
    one); launch() passes the plan to the checks that read the world (the directories they read are the
    plan's)."""

    cfg: SlipwayConfig
    environ: Mapping[str, str] = field(default_factory=dict)  # the launching environment
    exists: Callable[[str], bool] = os.path.exists  # plan tests answer it themselves
    estimates: Estimates | None = None
    plan: Plan | None = None

    @cached_property
    def layout(self) -> Layout:
        return layout_of(self.cfg)

    def require_plan(self) -> Plan:
        if self.plan is None:
            raise ValueError("a world check reads the plan's directories: pass Context(..., plan=plan)")
        return self.plan


@dataclass(frozen=True)
class Check:
    subject: Subject
    cost: Cost
    fn: Callable[[Context], list[Problem]]


# In the order the problems are reported (within one cost): the sections' own rules first, then the
# rules between sections, then the file checks, the guards and the estimates.
CHECKS: tuple[Check, ...] = (
    Check("run", "pure", run.section_problems),
    Check("layout", "pure", layout.layout_problems),
    Check("run", "pure", run.warmup_problems),
    Check("cluster", "pure", cluster.precision_problems),
    Check("cluster", "pure", cluster.cluster_problems),
    Check("container", "pure", container.container_problems),
    Check("data", "pure", data.data_source_problems),
    Check("tokenizer", "pure", tokenizer.tokenizer_source_problems),
    Check("cluster", "pure", cluster.eval_device_problems),
    Check("run", "pure", run.name_problems),
    Check("data", "pure", data.data_file_problems),
    Check("tokenizer", "pure", tokenizer.tokenizer_file_problems),
    Check("container", "pure", container.image_file_problems),
    Check("secrets", "pure", secrets.secret_problems),
    Check("secrets", "pure", secrets.hook_problems),
    Check("secrets", "pure", secrets.wandb_key_problems),
    Check("memory", "pure", memory.memory_problems),
    Check("cluster", "pure", cluster.time_limit_problems),
    Check("data", "inputs", data.data_problems),
    Check("tokenizer", "inputs", tokenizer.tokenizer_problems),
    Check("container", "inputs", container.image_problems),
    Check("data", "world", data.reused_data_problems),
    Check("checkpoints", "world", checkpoints.checkpoint_problems),
    Check("container", "world", container.pyxis_problems),
    Check("checkpoints", "world", checkpoints.active_problems),
)


def run_checks(ctx: Context, *costs: Cost) -> list[Problem]:
    """The problems of every check of the given costs, all of them (none stops the others)."""
    return [p for check in CHECKS if check.cost in costs for p in check.fn(ctx)]
