"""A sweep is all or nothing: every point is planned and checked before any is submitted.

Hydra's multirun calls ``launch.py``'s task function once per point. Slipway's sweeper
(``hydra_plugins/slipway_sweeper``, selected in ``hydra_conf/config.yaml``) calls it twice per point
inside :func:`collecting`, and each call hands the point to the :class:`Collector` instead of launching it:

1. **plan**: every point is composed, typed, planned, checked and rendered (flow.prepare); nothing is
   written. A point whose plan has problems keeps them (a config that does not even type is one problem).
2. **verdict** (:meth:`Collector.verdict`): one sweep summary — the points, each point's overrides, the
   plan figures that differ from the first point's, its problems, the device-hours of all of them
   together. A dry run prints the first point's plan in full (``sweep_plans=all``: every point's), then the
   summary; problems in any point refuse the whole sweep. Either way nothing was written: no sweep
   folder, no ``multirun.yaml``, no run directory.
3. **submit**: the points are recorded and submitted in order (flow.execute), each added to the sweep's
   manifest ``sweep.json`` as it is, and the summary lists the runs and their jobs. Points that need the
   same preprocessing share one job (its content key), as before.

A submission can still fail half-way for a reason no plan can know (``sbatch`` refusing a job, a disk that
filled up): the points submitted before it are in ``sweep.json`` and the error says so.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from orchestrator.base import redaction
from orchestrator.base.estimate import DEVICE_HOURS, GIB, fmt_duration
from orchestrator.base.facts import SweepInfo
from orchestrator.base.problems import PlanError
from orchestrator.base.schema import SlipwayConfig
from orchestrator.launch.flow import EXIT_PROBLEMS, LaunchResult, Prepared, execute, prepare
from orchestrator.planning.plan_format import format_plan
from orchestrator.record.launches import RunRecordError

MULTIRUN_YAML = "multirun.yaml"  # Hydra's record of a sweep's config, written once the sweep is submitted
PLAN, SUBMIT = "plan", "submit"


@dataclass
class Point:
    """One point of the sweep: its number, its own overrides, and its prepared launch or why it has none."""

    sweep: SweepInfo
    overrides: tuple[str, ...]  # the whole command line's (recorded with the launch)
    prepared: Prepared | None = None
    problems: list[str] = field(default_factory=list)
    result: LaunchResult | None = None

    def label(self, common: set[str]) -> str:
        """The point's overrides that the other points do not share (what the sweep varies)."""
        own = [o for o in self.sweep.overrides if o not in common]
        return " ".join(own) or "(the sweep's common overrides)"


@dataclass
class Collector:
    """The points of the sweep being launched, gathered by the task function (see the module doc)."""

    phase: str = PLAN
    points: dict[int, Point] = field(default_factory=dict)

    def point(self, sweep: SweepInfo, typed: Callable[[], SlipwayConfig], overrides: tuple[str, ...]) -> None:
        """The task function's call for one point: plan it (first pass) or submit it (second pass)."""
        if self.phase == PLAN:
            p = Point(sweep, overrides)
            self.points[sweep.point] = p
            try:
                p.prepared = prepare(typed(), sweep)
                p.problems = [str(x) for x in p.prepared.plan.problems]
            except (PlanError, RunRecordError) as err:  # a config that does not type; a damaged run record
                p.problems = [str(x) for x in err.problems] if isinstance(err, PlanError) else [str(err)]
            return
        p = self.points[sweep.point]
        if p.prepared is None or p.problems:
            raise RuntimeError(f"sweep point {sweep.point} has problems; the verdict refuses such a sweep")
        try:
            p.result = execute(p.prepared, io.StringIO(), p.overrides)  # its run and jobs: in the summary
        except BaseException:
            self._half_done(p)
            raise

    def _half_done(self, failed: Point) -> None:
        """What a sweep that failed while submitting (no plan can know that sbatch refuses) did submit."""
        done = [p for k, p in sorted(self.points.items()) if p.result is not None]
        where = failed.sweep.sweep_dir
        what = (f"points {', '.join(str(p.sweep.point) for p in done)} were submitted (their runs are in "
                f"{where}/sweep.json: python -m orchestrator status {where}; cancel them: python -m "
                f"orchestrator cancel {where})") if done else "no point was submitted before it"
        redaction.redacting(sys.stderr).write(f"slipway: sweep {failed.sweep.sweep_id}: submitting point "
                                              f"{failed.sweep.point} failed; {what}\n")

    @property
    def dry_run(self) -> bool:
        return any(p.prepared.cfg.dry_run for p in self.points.values() if p.prepared)

    @property
    def every_plan(self) -> bool:
        """sweep_plans=all: a dry run prints every point's plan in full."""
        return any(p.prepared.cfg.sweep_plans == "all" for p in self.points.values() if p.prepared)

    def verdict(self, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int | None:
        """After planning every point: the exit code when nothing is to be submitted (a dry run: 0, or 2
        with problems; problems: 2), None when every point is to be submitted. Prints the summary (and a
        dry run's plans)."""
        out, err = redaction.redacting(out), redaction.redacting(err)
        ordered = [self.points[k] for k in sorted(self.points)]
        for p in ordered:
            for warning in p.prepared.plan.warnings if p.prepared else ():
                err.write(f"warning: point {p.sweep.point}: {warning}\n")
        bad = [p for p in ordered if p.problems]
        if self.dry_run:
            planned = [x for x in ordered if x.prepared is not None]
            for p in (x.prepared for x in (planned if self.every_plan else planned[:1])):
                out.write(redaction.redact(format_plan(p.cfg, p.plan, p.scripts)) + "\n")
            if len(planned) > 1 and not self.every_plan:
                out.write(f"(the plan of point {planned[0].sweep.point} in full; each other point is a line "
                          "below with what differs from it: sweep_plans=all prints every plan)\n\n")
            out.write(summary(ordered, "dry run: nothing was written or submitted"))
            return EXIT_PROBLEMS if bad else 0
        if bad:
            err.write(summary(ordered, f"problems in {len(bad)} of {len(ordered)} point(s): nothing was "
                                       "submitted, no point of the sweep. Fix them (or drop those points) "
                                       "and launch the sweep again"))
            return EXIT_PROBLEMS
        return None

    def finish(self, multirun_yaml: str, out: TextIO = sys.stdout) -> None:
        """After submitting every point: Hydra's ``multirun.yaml`` (redacted) beside ``sweep.json``, and the
        summary with each point's run and jobs."""
        ordered = [self.points[k] for k in sorted(self.points)]
        sweep_dir = Path(ordered[0].sweep.sweep_dir)
        (sweep_dir / MULTIRUN_YAML).write_text(redaction.redact(multirun_yaml))
        done = f"submitted; follow: python -m orchestrator status {sweep_dir}"
        redaction.redacting(out).write(summary(ordered, done))


def figures(p: Prepared) -> dict[str, str]:
    """The plan figures a sweep's points are compared by (summary): what its overrides change."""
    lay, cfg, plan = p.plan.layout, p.cfg, p.plan
    out = {"layout": f"{lay.nodes}×{lay.tasks_per_node} tp {lay.tp} pp {lay.pp} dp {lay.dp}",
           "micro-batches": f"{lay.num_microbatches} of {cfg.train.micro_batch_size}",
           "global batch": str(lay.global_batch), "iterations": str(cfg.train.iters),
           "precision": cfg.train.precision}
    if plan.memory.device_bytes or plan.memory.total_bytes:
        out["memory/device"] = f"{plan.memory.total_bytes / GIB:.2f} GiB"
    if plan.time.known:
        out["step"] = f"{plan.time.step_s:.3g} s"
    return out


def summary(points: list[Point], outcome: str) -> str:
    """The one sweep summary: what every point shares (overrides, problems), a line per point (its
    overrides, run, device-hours and ETA, the plan figures that differ from the first planned point's, its
    own problems), the total, and the outcome."""
    first = points[0]
    several = len(points) > 1
    common = set.intersection(*(set(p.sweep.overrides) for p in points)) if several else set()
    shared = set.intersection(*(set(p.problems) for p in points)) if several else set()
    lines = [f"Slipway sweep {first.sweep.sweep_id}: {len(points)} point(s)"]
    if common:
        lines.append(f"  every point: {' '.join(o for o in first.sweep.overrides if o in common)}")
    if shared:
        lines.append(f"  every point's PROBLEMS ({len(shared)}):")
        lines += [f"    - {x}" for x in first.problems if x in shared]
    total = 0.0
    reference = next((p for p in points if p.prepared is not None), None)
    for p in points:
        head = f"  point {p.sweep.point}: {p.label(common)}"
        differs = ""
        if p.prepared is not None:
            plan = p.prepared.plan
            total += plan.time.device_hours
            head += (f"  run {plan.run_id}  {plan.time.device_hours:.1f} {DEVICE_HOURS}, ETA "
                     f"{fmt_duration(plan.time.eta_s)}")
            ref = figures(reference.prepared) if reference is not None and reference is not p else {}
            differs = "; ".join(f"{k} {v}" for k, v in figures(p.prepared).items()
                                if k in ref and ref[k] != v)
        lines.append(head)
        if differs:
            lines.append(f"      vs point {reference.sweep.point}: {differs}")
        if p.result is not None:
            jobs = " ".join(f"{s.stage}={s.job_id}" for s in p.result.submitted if s.job_id) or "-"
            lines.append(f"      {p.result.plan.run_dir}  jobs: {jobs}")
        own = [x for x in p.problems if x not in shared]
        if own:
            lines.append(f"      PROBLEMS ({len(own)}{' more' if shared else ''}):")
            lines += [f"        - {x}" for x in own]
    lines.append(f"  total: {total:.1f} {DEVICE_HOURS} for {len(points)} point(s)")
    lines.append(f"  {outcome}")
    return "\n".join(lines) + "\n"


_ACTIVE: list[Collector] = []


def active() -> Collector | None:
    """The collector of the sweep being launched in this process, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def collecting() -> Iterator[Collector]:
    """While a Slipway sweep runs its points through the task function (the module doc)."""
    col = Collector()
    _ACTIVE.append(col)
    try:
        yield col
    finally:
        _ACTIVE.remove(col)
