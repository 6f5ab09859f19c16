"""One training attempt's clock and its record (the terms: :mod:`trainer.goodput`).

The run marks where its time goes by switching the clock's current *span* (a start-up phase, the
training steps, a save, an evaluation, the shutdown): every second from the process start to the record's
last write lands in exactly one span, so nothing is counted twice and nothing between two marks is lost.
A step's time is attributed when the step ends (:meth:`AttemptClock.step`): the attempt's first step is
start-up (``first_step``: it compiles and warms up), a step of an iteration an earlier attempt had reached
is ``recompute``, any other is ``productive``. A switch costs a lock and a clock read: nothing a step
notices.

Only global rank 0 writes (one record per attempt). The record is rewritten atomically (a temporary file
renamed over it) by the heartbeat thread at every heartbeat, and by the run after its first step, after
each save and at its end; errors are logged, never raised (a full filesystem must not stop training).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from trainer.log import get_logger
from trainer.run_files import ALLOC_START_ENV, ATTEMPT_ENV, RunDir

log = get_logger(__name__)

VERSION = 1
# The start-up phases, in the order a run goes through them → what each holds.
STARTUP_PHASES = {
    "imports": "interpreter start and imports",
    "setup": "configuration, signal handlers, heartbeats",
    "rendezvous": "process group (rendezvous)",
    "preflight": "preflight (multi-rank)",
    "checkpoint_select": "choosing and verifying the checkpoint",
    "build": "model and optimizer",
    "kernel_check": "kernel self-check",
    "checkpoint_load": "checkpoint load",
    "data": "dataset indices and loaders",
    "wandb": "W&B",
    "first_step": "first step (compile, warm-up)",
}
STEP = "step"  # a step in progress (attributed when it ends; in a killed attempt's record: "other")
PRODUCTIVE, RECOMPUTE = "productive", "recompute"
CHECKPOINT, EVALUATION, SHUTDOWN = "checkpoint", "evaluation", "shutdown"
_SAVE_LOG = 100  # the saves a record lists one by one (the newest); totals cover all of them


def process_start_time() -> float:
    """This process's start (seconds since the epoch) from /proc: the interpreter's start, before any
    import; now when /proc cannot tell."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime (after comm)
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def attempt_identity(environ: Mapping[str, str]) -> dict[str, Any]:
    """(job, restart, attempt, allocation start) of this process from the job's environment: Slurm's job
    id and restart count, the job script's attempt number and allocation start (trainer.run_files'
    ATTEMPT_ENV, ALLOC_START_ENV; else Slurm's SLURM_JOB_START_TIME); a run outside Slurm is job
    ``local``, its allocation starting with its first process."""
    start = environ.get(ALLOC_START_ENV) or environ.get("SLURM_JOB_START_TIME", "")
    return {"job": environ.get("SLURM_JOB_ID") or "local", "restart": environ.get("SLURM_RESTART_COUNT", "0"),
            "attempt": environ.get(ATTEMPT_ENV, "0"),
            "alloc_start": float(start) if start.replace(".", "", 1).isdigit() else None}


class AttemptClock:
    """Where this attempt's wall time goes (see the module doc); ``begin`` once the rank is known."""

    def __init__(self, run_dir: str | None, environ: Mapping[str, str] | None = None) -> None:
        self.run_dir = run_dir
        self.identity = attempt_identity(os.environ if environ is None else environ)
        self.process_start = process_start_time()
        self._lock, self._write_lock = threading.Lock(), threading.Lock()
        now, wall = time.monotonic(), time.time()
        self._wall_offset = wall - now
        self.created_ms = int(wall * 1000)  # the record's name: attempts sort in time order
        self.seconds: dict[str, float] = {"imports": max(0.0, wall - self.process_start)}
        self.current, self._since = "setup", now
        self._step_pending = 0.0  # a step's time before an interruption (a save's wait, an evaluation)
        self.path: str | None = None
        self.previous: list[dict] = []  # the run's earlier attempts' records (read at begin)
        self.previous_iteration: int | None = None  # the furthest iteration an earlier attempt reached
        self.start_iteration: int | None = None
        self.iteration: int | None = None
        self.first_step_end: float | None = None
        self.saves: list[dict] = []
        self.save_totals = {"count": 0, "blocked_s": 0.0, "write_s": 0.0, "bytes": 0, "async": 0}
        self.load: dict | None = None
        self.world_size = 1
        self.ended: int | None = None

    # -- marks (the training thread) ----------------------------------------------------------------
    def begin(self, rank: int, world_size: int) -> None:
        """Rank 0 of a run with a run directory records; every rank keeps the clock (W&B is rank 0's)."""
        from trainer.goodput.account import read_records

        self.world_size = world_size
        if rank != 0 or not self.run_dir:
            return
        # Named by this clock's start, not the process's: two runs in one process (a notebook, the tests)
        # are two attempts, and /proc's process start, recomputed, jitters by a clock tick.
        ident = self.identity
        path = RunDir(self.run_dir).goodput_record(self.created_ms, ident["job"], ident["restart"],
                                                   ident["attempt"])
        self.previous = [r for r in read_records(self.run_dir) if r.get("_file") != path.name]
        reached = [r["iteration"] for r in self.previous if isinstance(r.get("iteration"), int)]
        self.previous_iteration = max(reached) if reached else None
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = str(path)
        self.write()

    def switch(self, span: str) -> str:
        """Count the time since the last mark in the current span and start ``span``; returns the span
        left (to switch back to after a save or an evaluation). The time of a step in progress is kept
        for :meth:`step` to attribute, however often the step is interrupted."""
        with self._lock:
            now = time.monotonic()
            if self.current == STEP:
                self._step_pending += now - self._since
            else:
                self._add(self.current, now - self._since)
            left, self.current, self._since = self.current, span, now
        return left

    def training(self, start_iteration: int) -> None:
        """The loop starts: what follows until the first step ends is the first step (start-up)."""
        self.start_iteration = self.iteration = start_iteration
        self.switch("first_step")

    def step(self, iteration: int) -> None:
        """A step ended at ``iteration``: its span is start-up (the first), recompute or productive."""
        with self._lock:
            now = time.monotonic()
            span, first = now - self._since, self.first_step_end is None
            if self.current == STEP:
                span += self._step_pending
            self._step_pending = 0.0
            if first:
                self._add("first_step", span)
                self.first_step_end = now + self._wall_offset
            elif self.previous_iteration is not None and iteration <= self.previous_iteration:
                self._add(RECOMPUTE, span)
            else:
                self._add(PRODUCTIVE, span)
            self.iteration, self.current, self._since = iteration, STEP, now
        if first:  # time to the first step is what a restart is judged by: on disk at once
            self.write()

    def moved(self, seconds: float, source: str, dest: str) -> None:
        """Re-file ``seconds`` of ``source`` under ``dest`` (the kernel self-check inside the build)."""
        with self._lock:
            seconds = min(seconds, self.seconds.get(source, 0.0))
            self._add(source, -seconds)
            self._add(dest, seconds)

    def save_started(self, iteration: int, mode: str, nbytes: int) -> dict:
        """A save began (``mode``: sync or async); :meth:`save_blocked` when training continues,
        :meth:`save_written` when its files are committed (from the writer thread when asynchronous)."""
        entry = {"iteration": iteration, "mode": mode, "bytes": nbytes, "blocked_s": None, "write_s": None}
        with self._lock:
            self.saves = [*self.saves, entry][-_SAVE_LOG:]
            t = self.save_totals
            t["count"] += 1
            t["bytes"] += nbytes
            t["async"] += mode == "async"
        return entry

    def save_blocked(self, entry: dict, seconds: float) -> None:
        """Training was blocked ``seconds`` more by this save (in the call, or waiting for its host copy
        before the next update)."""
        with self._lock:
            entry["blocked_s"] = round((entry["blocked_s"] or 0.0) + seconds, 4)
            self.save_totals["blocked_s"] += seconds

    def save_written(self, entry: dict, seconds: float) -> None:
        with self._lock:
            entry["write_s"] = round(seconds, 4)
            self.save_totals["write_s"] += seconds

    def loaded(self, iteration: int, nbytes: int, seconds: float) -> None:
        self.load = {"iteration": iteration, "bytes": nbytes, "seconds": round(seconds, 4)}

    def end(self, exit_code: int) -> None:
        """The attempt is over (its shutdown follows; the caller writes the last record after it)."""
        self.ended = exit_code

    # -- the record ---------------------------------------------------------------------------------
    def _add(self, span: str, seconds: float) -> None:
        self.seconds[span] = self.seconds.get(span, 0.0) + seconds

    def record(self) -> dict:
        """The record as of now (the open span counted under its name)."""
        with self._lock:
            now = time.monotonic()
            seconds = dict(self.seconds)
            seconds[self.current] = seconds.get(self.current, 0.0) + (now - self._since)
            if self._step_pending:
                seconds[STEP] = seconds.get(STEP, 0.0) + self._step_pending
            saves, totals = [dict(s) for s in self.saves], dict(self.save_totals)
        return {"version": VERSION, **self.identity, "world_size": self.world_size,
                "process_start": self.process_start, "updated": now + self._wall_offset,
                "first_step_end": self.first_step_end, "start_iteration": self.start_iteration,
                "iteration": self.iteration, "previous_iteration": self.previous_iteration,
                "ended": self.ended, "seconds": {k: round(v, 4) for k, v in seconds.items()},
                "saves": saves, "save_totals": totals, "load": self.load}

    def write(self) -> None:
        """Atomically replace the record (rank 0; nothing elsewhere). Never raises."""
        if self.path is None:
            return
        with self._write_lock:
            tmp = f"{self.path}.tmp-{os.getpid()}"
            try:
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump(self.record(), f)
                os.replace(tmp, self.path)
            except OSError as e:
                log.warning("could not write the goodput record %s: %s", self.path, e)

    def run_values(self) -> dict[str, float]:
        """The run's goodput so far (earlier attempts and this one), as W&B values."""
        from trainer.goodput.account import account, wandb_values

        return wandb_values(account([*self.previous, self.record()]))
