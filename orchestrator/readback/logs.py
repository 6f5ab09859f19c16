"""``python -m orchestrator logs RUN [STAGE]``: print or follow a stage's log, any job, restart or attempt.

Where a job logs (the names are render.py's and submitit's):

- a Slurm training job: ``<log_dir>/<stage>_<job>_r<restart>_a<attempt>_<task>.{out,err}`` per rank,
  restart (requeue) and retry attempt, and ``<stage>_<job>_batch.out``, the batch script's own decisions;
- another Slurm stage: ``<log_dir>/<stage>_<job>_<task>.{out,err}`` and its batch file;
- a local job: submitit's ``<folder>/<job>_<task>_log.{out,err}`` (follow.log_path).

``<log_dir>`` is the run's ``logs/`` for a run's own stage and ``<output>/logs/`` for a shared one (the
job's record names it; submit.stage_log_dir is the rule). By default the stage is the first one that
failed, else the first still queued or running, else training; its latest job (that of the run's latest
launch), that job's latest restart and attempt, task 0 — or the rank a failed training job failed with
first — and the trainer's stream, stderr. ``--follow``
prints as the job writes, moves on to the next attempt's file when a retry or requeue starts one, and
returns when the job has ended.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from orchestrator.record import launches
from orchestrator.stages.train import NAME as TRAIN
from orchestrator.world.queue import CANCELLED, FAILED, PENDING, RUNNING, alive, category, live_state
from orchestrator.world.runs import read_json
from trainer.run_files import JOB_RECORD, LOGS, SUBMITIT_LOG, RunDir

# A Slurm job's files after "<stage>_<job>_" (render.py), and a local job's (submitit's).
_SLURM = re.compile(r"(?:r(?P<restart>\d+)_a(?P<attempt>\d+)_)?(?P<task>\d+|batch|exclude_\d+)\."
                    r"(?P<stream>out|err)")
_LOCAL = re.compile(r"(?P<job>\d+)_(?P<task>\d+)_log\.(?P<stream>out|err)")


@dataclass(frozen=True)
class LogFile:
    """One log file of a job."""

    path: Path
    job: str
    task: str  # "0", "1" ... ; "batch" (the batch script's); "exclude_<id>" (the node-exclusion helper's)
    stream: str  # err | out
    restart: int = 0
    attempt: int = 0

    @property
    def what(self) -> str:
        where = f"restart {self.restart}, attempt {self.attempt}"
        return f"job {self.job}, {where}, task {self.task}, std{self.stream}"


class LogsError(ValueError):
    """What was asked for does not exist; the message says what does."""


def jobs_of(run_dir: Path, stage: str) -> list[dict]:
    """Every job entry of ``stage`` the run recorded, oldest first (every launch's). A shared stage whose
    job another run submitted (this run only depended on it) is found through its output folder."""
    data = launches.relocated(launches.read(run_dir), run_dir)  # a moved run: read where it stands
    entries = [e for _, s, e in launches.all_jobs(data) if s == stage]
    if not entries:
        folder = (launches.current(data).get("stages") or {}).get(stage, {}).get("dir")
        record = Path(folder) / JOB_RECORD if folder else None
        if record is not None and record.is_file():
            entries = [{**read_json(record), "shared": True}]
    return entries


def log_dir(run_dir: Path, entry: dict) -> Path:
    """Where a Slurm job of the run logged: recorded with the job, else submit.stage_log_dir's rule (a
    stage whose state lives outside the run directory is a shared one, logging beside its output)."""
    if entry.get("log_dir"):
        return Path(entry["log_dir"])
    state = Path(entry.get("state_dir", ""))
    inside = state.resolve().is_relative_to(Path(run_dir).resolve()) if state.parts else True
    return RunDir(run_dir).logs if inside else state / LOGS


def log_files(run_dir: Path, stage: str, entry: dict) -> list[LogFile]:
    """Every log file of one job, by restart, attempt, task and stream."""
    job = str(entry["job_id"])
    out = []
    if entry.get("executor") == "local":
        submitit = SUBMITIT_LOG.format(job=job, task="*", stream="*")
        for p in sorted(Path(entry.get("folder", "")).glob(submitit)):
            if m := _LOCAL.fullmatch(p.name):
                out.append(LogFile(p, job, m["task"], m["stream"]))
        return out
    head = f"{stage}_{job}_"
    for p in sorted(log_dir(run_dir, entry).glob(f"{head}*")):
        if m := _SLURM.fullmatch(p.name[len(head):]):
            out.append(LogFile(p, job, m["task"], m["stream"], int(m["restart"] or 0),
                               int(m["attempt"] or 0)))
    return sorted(out, key=lambda f: (f.restart, f.attempt, f.task, f.stream))


def default_stage(rows: list) -> str:
    """The stage ``logs`` shows without one named: the first that failed, else the first queued or
    running, else training (status rows, in stage order)."""
    for wanted in ((FAILED, CANCELLED), (PENDING, RUNNING)):
        hit = next((r.stage for r in rows if category(r.state) in wanted), None)
        if hit:
            return hit
    names = [r.stage for r in rows]
    return TRAIN if TRAIN in names or not names else names[-1]


def default_task(rows: list, stage: str, job: str | None) -> str:
    """The task ``logs`` shows without one named: the rank the stage's latest job failed with first (its
    status row: readback/culprit.py), whose log holds the cause — rank 0's often holds only a peer's
    consequence — else 0."""
    row = next((r for r in rows if r.stage == stage), None)
    first = getattr(row, "first_rank", None)
    return str(first) if first is not None and job in (None, getattr(row, "job_id", None)) else "0"


@dataclass(frozen=True)
class Selection:
    """Which file of a stage's jobs: None picks the latest (job, restart, attempt); task 0 and stderr."""

    job: str | None = None
    restart: int | None = None
    attempt: int | None = None
    task: str = "0"
    stream: str = "err"


def pick(run_dir: Path, stage: str, sel: Selection) -> tuple[dict, list[LogFile]]:
    """(the job entry, its files matching ``sel`` oldest first); raises :class:`LogsError` saying what
    there is instead."""
    entries = jobs_of(run_dir, stage)
    if not entries:
        raise LogsError(f"run {run_dir.name} has no job for stage {stage!r}")
    ids = [str(e["job_id"]) for e in entries]
    if sel.job is not None and sel.job not in ids:
        raise LogsError(f"stage {stage} of run {run_dir.name} has no job {sel.job}; its jobs: "
                        f"{', '.join(ids)}")
    entry = entries[ids.index(sel.job)] if sel.job is not None else entries[-1]
    files = [f for f in log_files(run_dir, stage, entry)
             if f.task == sel.task and f.stream == sel.stream
             and sel.restart in (None, f.restart) and sel.attempt in (None, f.attempt)]
    return entry, files


def listing(run_dir: Path, stage: str) -> str:
    """Every log file of every job of the stage (``--list``)."""
    lines = []
    for entry in jobs_of(run_dir, stage):
        for f in log_files(run_dir, stage, entry):
            size = f.path.stat().st_size if f.path.exists() else 0
            lines.append(f"{f.what:<48} {size:>10} B  {f.path}")
    return "\n".join(lines) or f"no log file of stage {stage} yet (its jobs have not started)"


def _tail(text: str, lines: int | None) -> str:
    """The last ``lines`` lines of ``text`` (all of it for None)."""
    if lines is None:
        return text
    kept = text.splitlines(keepends=True)[-lines:] if lines > 0 else []
    return "".join(kept)


def show(files: list[LogFile], lines: int | None, out: TextIO) -> None:
    """Print the latest of ``files`` (its last ``lines`` lines)."""
    f = files[-1]
    out.write(_tail(f.path.read_text(errors="replace"), lines))


class Follower:
    """``--follow``: the chosen file as it grows; the next attempt's (or restart's) file of the same task
    and stream once one appears (unless an attempt was pinned); done when the job has ended."""

    def __init__(self, run_dir: Path, stage: str, sel: Selection, out: TextIO, lines: int | None = 10,
                 poll_s: float = 0.5, check_s: float = 5.0) -> None:
        self.run_dir, self.stage, self.sel, self.out = run_dir, stage, sel, out
        self.lines, self.poll_s, self.check_s = lines, poll_s, check_s
        self.current: LogFile | None = None
        self.offset = 0

    def _switch(self, f: LogFile, first: bool) -> None:
        if not first:
            self.out.write(f"──── {f.what}: {f.path} ────\n")
        text = f.path.read_text(errors="replace")
        self.out.write(_tail(text, self.lines) if first else text)
        self.current, self.offset = f, len(text.encode())

    def _more(self) -> None:
        assert self.current is not None
        with open(self.current.path, "rb") as fh:
            fh.seek(self.offset)
            chunk = fh.read()
        end = max(chunk.rfind(b"\n"), chunk.rfind(b"\r")) + 1
        if end:
            self.out.write(chunk[:end].decode("utf-8", errors="replace"))
            self.offset += end
        self.out.flush()

    def step(self) -> None:
        """One look: new text, or a newer file of the job."""
        entry, files = pick(self.run_dir, self.stage, self.sel)
        if files and (self.current is None or files[-1].path != self.current.path):
            if self.current is not None:
                self._more()  # the last lines of the previous attempt first
            self._switch(files[-1], self.current is None)
        elif self.current is not None:
            self._more()

    def run(self) -> None:
        entry, _ = pick(self.run_dir, self.stage, self.sel)
        job, executor = str(entry["job_id"]), entry.get("executor", "slurm")
        next_check = 0.0
        while True:
            self.step()
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + self.check_s
                state = live_state(job, executor, entry.get("folder"))
                if state is None or not alive(state):
                    self.step()  # what the job wrote before it ended
                    return
            time.sleep(self.poll_s)
