"""The run as configured: each section's own rules (defined once beside its fields, trainer/config and
orchestrator/schema), the warm-up against the run's length, and the names that become folders."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from orchestrator.problems import Problem

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
