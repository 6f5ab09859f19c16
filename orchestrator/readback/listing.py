"""``python -m orchestrator list [PATH]``: the runs under ``runs_root`` (or an experiment's folder, a sweep, a
run), one line each: state, the stage it is at, the last logged iteration, the last checkpoint, the last
loss, when it was first launched, its name.

Fast however many runs there are: one ``squeue`` and one ``sacct`` call for all of them (queue.py), the
metrics file read from its end (trainer/metrics_file.py last_record), nothing of the heartbeats or the
logs (``status`` reads those for the runs you ask it about). Runs are found as ``status`` and ``cancel``
find them (runs.run_dirs_of).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from orchestrator.readback.status import job_state, slurm_ids, slurm_note
from orchestrator.record import launches
from orchestrator.record.launches import current, is_incomplete
from orchestrator.world.progress import checkpoint_iter
from orchestrator.world.queue import CANCELLED, DONE, FAILED, PENDING, RUNNING, category, query_slurm_checked
from orchestrator.world.runs import run_dirs_of
from trainer.metrics_file import TRAIN_LOSS, last_record

INCOMPLETE = "INCOMPLETE"  # the latest launch stopped before it submitted everything (launches.py)
UNREADABLE = "RECORD DAMAGED"  # run.json does not read (status says how to recover)


@dataclass
class RunLine:
    run: str  # the run directory, relative to what was listed
    state: str  # the run's: the state of the stage that decides it (below)
    stage: str = ""  # that stage
    iteration: int | None = None  # the last iteration the trainer logged
    checkpoint: int | None = None
    loss: float | None = None
    created: str = ""
    name: str = ""


def run_state(states: list[tuple[str, str]]) -> tuple[str, str]:
    """(state, stage) of a run from its stages' (stage, state) in stage order: the first stage that failed
    or was cancelled; else the first running; else the first queued; else COMPLETED (every stage done)."""
    for wanted in ((FAILED, CANCELLED), (RUNNING,), (PENDING,)):
        hit = next(((st, s) for s, st in states if category(st) in wanted), None)
        if hit:
            return hit
    if states and all(category(st) == DONE for _, st in states):
        return "COMPLETED", states[-1][0]
    return "-", ""


def collect_runs(path: str) -> tuple[list[RunLine], str]:
    """A line per run under ``path``, and why squeue failed ("" when it answered)."""
    root = Path(path).resolve()
    found = []
    for run_dir in run_dirs_of(path, below=True):
        try:
            found.append((run_dir, launches.relocated(launches.read(run_dir), run_dir)))
        except launches.RunRecordError:
            found.append((run_dir, None))
    latest = {r: current(d) for r, d in found if d is not None}
    sq, sa, squeue_error = query_slurm_checked(slurm_ids(list(latest.values())))
    out = []
    for run_dir, data in found:
        inside = run_dir.is_relative_to(root) and run_dir != root
        rel = str(run_dir.relative_to(root)) if inside else str(run_dir)
        if data is None:
            out.append(RunLine(rel, UNREADABLE))
            continue
        launch = latest[run_dir]
        states = [(s, job_state(es[-1], launch, sq, sa, not squeue_error)[0])
                  for s, es in launch.get("jobs", {}).items() if es]
        state, stage = run_state(states)
        if launch and launch.get("state") != launches.SUBMITTED and is_incomplete(launch):
            state = INCOMPLETE
        rec = last_record(run_dir, TRAIN_LOSS)
        out.append(RunLine(rel, state, stage, int(rec["iteration"]) if rec else None,
                           checkpoint_iter(run_dir, launch), float(rec[TRAIN_LOSS]) if rec else None,
                           str(data.get("created") or ""), str(data.get("name") or "")))
    return out, squeue_error


def format_runs(lines: list[RunLine], squeue_error: str = "") -> str:
    head = ("run", "state", "stage", "iter", "ckpt", "loss", "created", "name")
    rows = [head] + [(r.run, r.state, r.stage, "" if r.iteration is None else str(r.iteration),
                      "" if r.checkpoint is None else str(r.checkpoint),
                      "" if r.loss is None else f"{r.loss:.4f}", r.created,
                      r.name if r.name != Path(r.run).name else "") for r in lines]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    text = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    if not lines:
        text.append("(no runs)")
    if squeue_error:
        text += ["", slurm_note(squeue_error)]
    return "\n".join(text) + "\n"
