"""Every configuration check of a launch, grouped by subject and tagged with its cost.

One module per subject: ``run`` (each config section's own rules, warm-up, names), ``data``,
``tokenizer``, ``layout`` (the parallel layout and the batch), ``memory``, ``container`` (pyxis and
Charliecloud included), ``cluster`` (its devices, hardware and time limit), ``slurm`` (what Slurm itself
says of the jobs: its partitions and their MaxTime, the user's accounts and QoS), ``secrets`` (secrets,
test hooks, the W&B key) and ``checkpoints``. A check is a function ``(Context) -> list[Problem]``;
:data:`CHECKS` lists them all, each with its subject and its cost:

- ``pure``: the config, the launching environment and the plan's estimates.
- ``inputs``: reads the input files: whether they exist, and what they hold (documents, tokenizer files,
  the container image).
- ``world``: reads the world: the cache, the run's checkpoints, the queue, ``srun``, ``sinfo``,
  ``sacctmgr``, the W&B key file.

Each check also says when it runs (``at``): ``plan``, in :func:`~orchestrator.planning.plan.make_plan` (pure
ones, and the cheap ones a plan test answers through the injected ``exists`` or the environment), or
``launch``, in :func:`orchestrator.launch.flow.launch` after the plan (those that open files or read its
directories). Every problem is reported at once either way. A new check goes into its subject's module
and one row here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

from orchestrator.base.plan_types import Context
from orchestrator.base.problems import Problem
from orchestrator.checks import (
    checkpoints,
    cluster,
    container,
    data,
    layout,
    memory,
    run,
    secrets,
    slurm,
    tokenizer,
)

Subject = Literal["run", "data", "tokenizer", "layout", "memory", "container", "cluster", "slurm", "secrets",
                  "checkpoints"]
Cost = Literal["pure", "inputs", "world"]
When = Literal["plan", "launch"]
SUBJECTS: tuple[Subject, ...] = get_args(Subject)
COSTS: tuple[Cost, ...] = get_args(Cost)


@dataclass(frozen=True)
class Check:
    subject: Subject
    cost: Cost
    fn: Callable[[Context], list[Problem]]
    at: When = "plan"


# In the order the problems are reported (within one cost): the sections' own rules first, then the
# rules between sections, then the file checks, the guards and the estimates.
CHECKS: tuple[Check, ...] = (
    Check("run", "pure", run.section_problems),
    Check("layout", "pure", layout.layout_problems),
    Check("layout", "pure", layout.auto_layout_problems),
    Check("run", "pure", run.warmup_problems),
    Check("cluster", "pure", cluster.precision_problems),
    Check("cluster", "pure", cluster.cluster_problems),
    Check("cluster", "pure", cluster.site_problems),
    Check("cluster", "pure", cluster.task_problems),
    Check("container", "pure", container.container_problems),
    Check("data", "pure", data.data_source_problems),
    Check("tokenizer", "pure", tokenizer.tokenizer_source_problems),
    Check("cluster", "pure", cluster.eval_device_problems),
    Check("run", "pure", run.name_problems),
    Check("data", "inputs", data.data_file_problems),
    Check("tokenizer", "inputs", tokenizer.tokenizer_file_problems),
    Check("container", "inputs", container.image_file_problems),
    Check("secrets", "pure", secrets.secret_problems),
    Check("secrets", "pure", secrets.hook_problems),
    Check("secrets", "world", secrets.wandb_key_problems),
    Check("memory", "pure", memory.memory_problems),
    Check("cluster", "pure", cluster.time_limit_problems),
    Check("data", "inputs", data.data_problems, "launch"),
    Check("tokenizer", "inputs", tokenizer.tokenizer_problems, "launch"),
    Check("container", "inputs", container.image_problems, "launch"),
    Check("data", "world", data.reused_data_problems, "launch"),
    Check("checkpoints", "world", checkpoints.checkpoint_problems, "launch"),
    Check("container", "world", container.pyxis_problems, "launch"),
    Check("container", "inputs", container.charliecloud_image_problems, "launch"),
    Check("container", "world", container.charliecloud_problems, "launch"),
    Check("cluster", "world", cluster.controller_problems, "launch"),
    Check("slurm", "world", slurm.partition_problems, "launch"),
    Check("slurm", "world", slurm.account_problems, "launch"),
    Check("run", "world", run.storage_problems, "launch"),
    Check("checkpoints", "world", checkpoints.record_problems, "launch"),
    Check("checkpoints", "world", checkpoints.active_problems, "launch"),
)


def run_checks(ctx: Context, *costs: Cost, at: When | None = None) -> list[Problem]:
    """The problems of every check of the given costs (all costs when none is given) that runs ``at`` (any
    time when None): all of them, none stops the others."""
    return [p for check in CHECKS if (not costs or check.cost in costs) and at in (None, check.at)
            for p in check.fn(ctx)]
