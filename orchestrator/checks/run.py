"""The run as configured: each section's own rules (defined once beside its fields, trainer/config and
orchestrator/schema), the warm-up against the run's length, and the names that become folders."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from orchestrator.problems import Problem
from orchestrator.stages.train import NAME as TRAIN

if TYPE_CHECKING:
    from orchestrator.checks import Context


def section_problems(ctx: Context) -> list[Problem]:
    """Each section's own rules; the sections record them instead of raising, so all are reported."""
    return [Problem(i.code, i.key, i.value, i.message, i.fix) for i in ctx.cfg.problems()]


def warmup_problems(ctx: Context) -> list[Problem]:
    """Warm-up longer than the default decay length (train.iters); with optim.decay_iters set,
    OptimConfig checks this itself."""
    o, t = ctx.cfg.optim, ctx.cfg.train
    if o.decay_iters is None and o.warmup_iters > t.iters:
        return [Problem("warmup", "optim.warmup_iters", o.warmup_iters, f"exceeds the decay length {t.iters}",
                        "lower optim.warmup_iters")]
    return []


# Names that become one path component (runs/<experiment>/<run_id>/) and job names: no separators, no
# "..", no spaces or shell characters, so they cannot escape runs_root or split a script's argument.
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")


def name_problems(ctx: Context) -> list[Problem]:
    out = []
    for key, value in (("run_id", ctx.cfg.run_id), ("experiment", ctx.cfg.experiment)):
        if value is not None and (not SAFE_NAME.match(value) or ".." in value):
            out.append(Problem(
                "name", key, value,
                "becomes a folder name and part of job names: it may hold only letters, digits and '._+-' "
                "(at most 128, no '..', not starting with '.' or '-')",
                f"choose another {key}, e.g. {key}=20261202-lr3e-4"))
    return out


def _unwritable(path: str) -> tuple[str, str] | None:
    """(the folder in the way, why) when ``path`` cannot be written or created; None when it can. The
    folder in the way is the nearest existing one on its way: a file, read-only (its filesystem, or its
    permissions for this user), or none at all."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return probe, "no folder on its way exists"
        probe = parent
    created = "" if probe == os.path.abspath(path) else ", so it cannot be created"
    if not os.path.isdir(probe):
        return probe, f"{probe} is a file, not a folder{created}"
    try:
        read_only = bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
    except OSError as err:
        return probe, f"{probe} cannot be read ({err.strerror})"
    if read_only or not os.access(probe, os.W_OK | os.X_OK):
        what = "is on a read-only filesystem" if read_only else "is not writable by this user"
        return probe, f"{probe} {what}{created}"
    return None


def storage_problems(ctx: Context) -> list[Problem]:
    """The run directory, the shared cache and the checkpoint directory must be writable (or creatable):
    found here, not as a traceback when the launch writes run.json or a job its first checkpoint. One
    problem per folder in the way (a checkpoint dir inside a read-only run dir is the same problem)."""
    plan = ctx.require_plan()
    cfg = ctx.cfg
    ckpt = next((s.job.trainer_config["checkpoint"]["dir"] for s in plan.stages if s.name == TRAIN), None)
    where = [("runs_root", cfg.runs_root, plan.run_dir),
             ("cache_dir", cfg.cache_dir or os.path.join(cfg.runs_root, "_cache"), None),
             ("checkpoint.dir", ckpt, None)]
    out, seen = [], set()
    for key, value, path in where:
        path = path or value
        found = _unwritable(path) if path else None
        if found and found[0] not in seen:
            seen.add(found[0])
            out.append(Problem("storage", key, value, f"{path} is where the run writes, but {found[1]}",
                               f"set {key} to a folder you can write that every node sees (e.g. "
                               f"{key}=/shared/$USER/slipway), or fix its permissions"))
    return out
