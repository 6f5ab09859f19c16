"""A run's goodput from its attempts' records (the terms: :mod:`trainer.goodput`): the one accounting that
status, the summary and W&B all show."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from trainer.goodput.clock import (
    CHECKPOINT,
    EVALUATION,
    PRODUCTIVE,
    RECOMPUTE,
    STARTUP_PHASES,
)
from trainer.run_files import RunDir

# The causes of lost time, in the order they are shown.
CAUSES = ("launch", "startup", "checkpoint", "evaluation", "recompute", "restart", "other")
_LABELS = {"startup": "start-up", "checkpoint": "checkpoints", "restart": "restarts"}


@dataclass
class Goodput:
    """The accounting of a run's records (seconds)."""

    attempts: int = 0
    allocations: int = 0
    allocated_s: float = 0.0
    productive_s: float = 0.0
    lost: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    startup: dict[str, float] = field(default_factory=dict)  # start-up phase → seconds, all attempts
    waiting_s: float = 0.0  # between allocations (queued again after a requeue): not allocated
    first_step_s: list[float] = field(default_factory=list)  # per attempt: process start → first step end
    saves: int = 0
    async_saves: int = 0
    save_blocked_s: float = 0.0
    save_write_s: float = 0.0
    save_bytes: int = 0

    @property
    def fraction(self) -> float | None:
        return self.productive_s / self.allocated_s if self.allocated_s > 0 else None


def read_records(run_dir: str) -> list[dict]:
    """Every readable attempt record of the run, oldest first (each with its file name as ``_file``)."""
    folder = RunDir(run_dir).goodput
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".json"))
    except OSError:
        return []
    out = []
    for name in names:
        try:
            with open(folder / name, encoding="utf-8") as f:
                rec = json.load(f)
        except (OSError, ValueError):
            continue  # replaced while read (never torn: written by rename); next look reads it
        if isinstance(rec, dict) and isinstance(rec.get("seconds"), dict):
            out.append({**rec, "_file": name})
    return out


def _allocations(records: list[dict]) -> list[list[dict]]:
    """The records grouped by allocation (job, restart), each group and the groups in time order."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in sorted(records, key=lambda r: float(r["process_start"])):
        groups.setdefault((str(r.get("job")), str(r.get("restart"))), []).append(r)
    return sorted(groups.values(), key=lambda g: float(g[0]["process_start"]))


def _attempt(g: Goodput, r: dict) -> None:
    """One attempt's spans into ``g``: start-up phases, productive, and the causes it knows itself."""
    seconds = {k: max(0.0, float(v)) for k, v in r["seconds"].items()}
    span = max(0.0, float(r["updated"]) - float(r["process_start"]))
    startup = {k: seconds.get(k, 0.0) for k in STARTUP_PHASES if seconds.get(k)}
    for k, v in startup.items():
        g.startup[k] = g.startup.get(k, 0.0) + v
    known = {"startup": sum(startup.values()), "checkpoint": seconds.get(CHECKPOINT, 0.0),
             "evaluation": seconds.get(EVALUATION, 0.0), "recompute": seconds.get(RECOMPUTE, 0.0)}
    productive = seconds.get(PRODUCTIVE, 0.0)
    g.productive_s += productive
    for k, v in known.items():
        g.lost[k] += v
    g.lost["other"] += max(0.0, span - productive - sum(known.values()))
    if r.get("first_step_end"):
        g.first_step_s.append(float(r["first_step_end"]) - float(r["process_start"]))
    totals = r.get("save_totals") or {}
    g.saves += int(totals.get("count", 0))
    g.async_saves += int(totals.get("async", 0))
    g.save_blocked_s += float(totals.get("blocked_s", 0.0))
    g.save_write_s += float(totals.get("write_s", 0.0))
    g.save_bytes += int(totals.get("bytes", 0))


def account(records: list[dict]) -> Goodput:
    """Goodput over every attempt of a run (see the package doc for each term)."""
    g = Goodput()
    previous_end = None
    for group in _allocations(records):
        first, last = group[0], group[-1]
        starts = [float(r["alloc_start"]) for r in group if r.get("alloc_start")]
        start = min([*starts, float(first["process_start"])])
        g.allocations += 1
        g.allocated_s += max(0.0, float(last["updated"]) - start)
        g.lost["launch"] += float(first["process_start"]) - start
        for before, after in zip(group, group[1:], strict=False):
            g.lost["restart"] += max(0.0, float(after["process_start"]) - float(before["updated"]))
        for r in group:
            g.attempts += 1
            _attempt(g, r)
        if previous_end is not None:
            g.waiting_s += max(0.0, start - previous_end)
        previous_end = float(last["updated"])
    return g


def duration(seconds: float) -> str:
    """``42 s``, ``3.5 min``, ``2.1 h``."""
    if seconds < 90:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def format_lines(g: Goodput) -> list[str]:
    """The run's goodput in a few lines: the headline, the lost time by cause, start-up by phase, saves."""
    if g.fraction is None:
        return []
    attempts = f"{g.attempts} attempt{'s' if g.attempts != 1 else ''}"
    head = (f"goodput {100 * g.fraction:.1f} %: {duration(g.productive_s)} productive of "
            f"{duration(g.allocated_s)} allocated ({attempts}, {g.allocations} allocation"
            f"{'s' if g.allocations != 1 else ''})")
    if g.waiting_s > 0:
        head += f"; {duration(g.waiting_s)} waiting between allocations (not allocated)"
    lost = [f"{_LABELS.get(k, k)} {duration(v)}" for k, v in g.lost.items() if v >= 0.05]
    lines = [head, "lost: " + (", ".join(lost) or "nothing")]
    if g.startup:
        phases = sorted(g.startup.items(), key=lambda kv: -kv[1])
        firsts = ", ".join(duration(s) for s in g.first_step_s)
        lines.append(f"start-up by phase: {', '.join(f'{k} {duration(v)}' for k, v in phases if v >= 0.05)}"
                     f"; time to first step per attempt: {firsts or 'none reached'}")
    if g.saves:
        mode = f"{g.async_saves} asynchronous" if g.async_saves else "synchronous"
        each = g.save_bytes / g.saves
        rate = f", written at {g.save_bytes / g.save_write_s / 2**20:.0f} MiB/s" if g.save_write_s > 0 else ""
        lines.append(f"checkpoints: {g.saves} saves ({mode}), training blocked "
                     f"{g.save_blocked_s / g.saves:.2f} s per save, {each / 2**30:.2f} GiB each{rate}")
    return lines


def wandb_values(g: Goodput) -> dict[str, float]:
    """The figures W&B plots (``goodput/*``): fraction, allocated, productive and each cause's seconds."""
    if g.fraction is None:
        return {}
    out = {"goodput/fraction": g.fraction, "goodput/allocated_s": g.allocated_s,
           "goodput/productive_s": g.productive_s, "goodput/attempts": float(g.attempts),
           "goodput/waiting_s": g.waiting_s}
    out.update({f"goodput/lost_{k}_s": v for k, v in g.lost.items()})
    if g.saves:
        out["goodput/save_blocked_s_mean"] = g.save_blocked_s / g.saves
    return out
