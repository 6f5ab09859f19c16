"""The run as configured: each section's own rules (defined once beside its fields, trainer/config and
orchestrator/schema), values far outside any sane range, the warm-up against the run's length, and the
names that become folders."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from orchestrator.problems import Problem

if TYPE_CHECKING:
    from orchestrator.checks import Context


def section_problems(ctx: Context) -> list[Problem]:
    """Each section's own rules; the sections record them instead of raising, so all are reported."""
    return [Problem(i.code, i.key, i.value, i.message, i.fix) for i in ctx.cfg.problems()]


# Bounds no pre-training recipe comes near (an order of magnitude past the published ones: GPT-3's peak
# learning rates 0.6e-4 to 6e-4, weight decay 0.1, Adam's eps 1e-8, init std 0.02): a value beyond is a
# typo (3e4 for 3e-4) that would cost a queue wait and end in a non-finite loss. (key, section, field,
# upper bound, typical value); every value must also be > 0 (weight decay >= 0: its section's rule).
SANE_UPPER = (
    ("optim.lr", "optim", "lr", 0.1, "3e-4"),
    ("optim.min_lr", "optim", "min_lr", 0.1, "3e-5"),
    ("optim.weight_decay", "optim", "weight_decay", 1.0, "0.1"),
    ("optim.adam_eps", "optim", "adam_eps", 1e-3, "1e-8"),
    ("model.init_std", "model", "init_std", 1.0, "0.02"),
)


def _flipped(value: float, upper: float) -> str:
    """``3e4`` → ``, did you mean 3e-04?`` when the exponent's sign flipped lands in range."""
    if value <= 1:
        return ""
    mantissa, exponent = f"{value:e}".split("e")
    guess = float(f"{mantissa}e-{int(exponent)}")
    return f"; did you mean {guess:g}?" if 0 < guess <= upper else ""


def range_problems(ctx: Context) -> list[Problem]:
    """Values far outside any sane range (:data:`SANE_UPPER`)."""
    out = []
    for key, section, name, upper, typical in SANE_UPPER:
        value = getattr(getattr(ctx.cfg, section), name)
        if isinstance(value, int | float) and value > upper:
            out.append(Problem("insane_value", key, value, f"is far above any pre-training recipe's (at most "
                               f"{upper:g} here; typical {typical})",
                               f"set {key} to a value <= {upper:g}{_flipped(value, upper)}"))
    return out


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
