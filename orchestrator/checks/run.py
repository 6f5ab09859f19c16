"""The run as configured: each section's own rules (defined once beside its fields, trainer/config and
orchestrator/base/schema), values far outside any sane range, the warm-up against the run's length, and the
names that become folders."""

from __future__ import annotations

import os
import re

from orchestrator.base.plan_types import Context
from orchestrator.base.problems import Problem
from orchestrator.stages.train import NAME as TRAIN


def section_problems(ctx: Context) -> list[Problem]:
    """Each section's own rules; the sections record them instead of raising, so all are reported."""
    return [Problem(i.code, i.key, i.value, i.message, i.fix) for i in ctx.cfg.problems()]


# Bounds no pre-training recipe comes near (an order of magnitude past the published ones: GPT-3's peak
# learning rates 0.6e-4 to 6e-4, weight decay 0.1, Adam's eps 1e-8, init std 0.02): a value beyond is most
# likely a typo (3e4 for 3e-4) that would end in a non-finite loss after a queue wait. Flagged, not
# refused: a run may diverge on purpose (the fault tests do). (key, section, field, upper bound, typical)
SANE_UPPER = (
    ("optim.lr", "optim", "lr", 0.1, "3e-4"),
    ("optim.min_lr", "optim", "min_lr", 0.1, "3e-5"),
    ("optim.weight_decay", "optim", "weight_decay", 1.0, "0.1"),
    ("optim.adam_eps", "optim", "adam_eps", 1e-3, "1e-8"),
    ("model.init_std", "model", "init_std", 1.0, "0.02"),
)


def _flipped(value: float, upper: float) -> str:
    """``3e4`` → ``; did you mean 0.0003?`` when the exponent's sign flipped lands in range."""
    if value <= 1:
        return ""
    mantissa, exponent = f"{value:e}".split("e")
    guess = float(f"{mantissa}e-{int(exponent)}")
    return f"; did you mean {guess:g}?" if 0 < guess <= upper else ""


def insane_values(ctx: Context) -> list[str]:
    """Values far outside any sane range (:data:`SANE_UPPER`), as the plan's warnings (no check: they are
    said before submitting, never refused)."""
    out = []
    for key, section, name, upper, typical in SANE_UPPER:
        value = getattr(getattr(ctx.cfg, section), name)
        if isinstance(value, int | float) and value > upper:
            out.append(f"{key}={value:g} is far above any pre-training recipe's (at most {upper:g}; typical "
                       f"{typical}): the run would most likely diverge{_flipped(value, upper)}")
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
