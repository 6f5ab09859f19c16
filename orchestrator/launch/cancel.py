"""Cancelling a run: every job it recorded that is still queued or running, on Slurm (one ``scancel``) and
on this machine (orchestrator/world/local_jobs.py: no process of the job survives). The cancelled jobs are
marked in ``run.json`` (launches.py) so ``status`` says CANCELLED, and a relaunch resumes the run from its
last complete checkpoint. Used by ``python -m orchestrator cancel RUN`` and by a waiting launch that is
interrupted (flow.py), whose signal handling (:class:`Stops`) lives here too."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TextIO

from orchestrator.record import launches
from orchestrator.world import local_jobs
from orchestrator.world.queue import alive, local_job_alive, query_slurm


def cancel_run(run_dir: str, launch_n: int | None = None, started: dict[str, Any] | None = None) -> list[str]:
    """Cancel the run's live jobs (of launch ``launch_n`` only, when given); one line per job cancelled.
    ``started``: {job id: submitit job} this process started (reaped after)."""
    data = launches.read(run_dir)
    entries = [(n, stage, e) for n, stage, e in launches.all_jobs(data) if launch_n in (None, n)]
    slurm = {str(e["job_id"]): (n, stage) for n, stage, e in entries if e.get("executor", "slurm") == "slurm"}
    squeue, _ = query_slurm(list(slurm))
    live = [j for j in slurm if j in squeue and alive(squeue[j][0])]
    lines, done = [], {}
    if live:
        res = subprocess.run(["scancel", *live], capture_output=True, text=True, timeout=60)
        if res.returncode != 0:
            lines.append(f"scancel {' '.join(live)} failed: {res.stderr.strip()}")
        else:
            for j in live:
                lines.append(f"{slurm[j][1]} job {j} cancelled (scancel)")
                done.setdefault(slurm[j][0], []).append(j)
    # Dependants first (the stages' reverse order): a job still waiting for its upstream must be cancelled
    # as it waits, not find its upstream gone first and fail "not running (afterok)".
    for n, stage, e in reversed(entries):
        jid = str(e["job_id"])
        if e.get("executor") != "local" or not local_job_alive(jid, e.get("folder")):
            continue
        pids = local_jobs.cancel(jid, str(e.get("folder", "")), job=(started or {}).get(jid))
        if pids:
            lines.append(f"{stage} job {jid} cancelled ({len(pids)} process(es) ended)")
            done.setdefault(n, []).append(jid)
    if done:
        launches.LaunchRecord.load(run_dir).mark_cancelled(done)
    return lines


class Interrupted(KeyboardInterrupt):
    """The launcher was told to stop (Ctrl-C, SIGTERM, SIGHUP) while it waited; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class Stops:
    """While a launch waits for its jobs, SIGINT, SIGTERM and SIGHUP all stop it the same way (the default
    of the last two would kill the launcher and leave the local jobs running: they are in sessions of
    their own: orchestrator/world/local_jobs.py). In :meth:`deferred` (recording and submitting) a signal is
    held until the section ends, so no job is submitted without being recorded."""

    holding: bool = False
    pending: int | None = None

    def _handle(self, signum: int, _frame: object) -> None:
        if self.holding:
            self.pending = self.pending or signum
        else:
            raise Interrupted(signum)

    @contextmanager
    def installed(self) -> Iterator[Stops]:
        before = {sig: signal.signal(sig, self._handle) for sig in STOPS}
        try:
            yield self
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.pending is not None:
            raise Interrupted(self.pending)


@contextmanager
def ignoring_stops() -> Iterator[None]:
    """While a cancellation runs: a second Ctrl-C must not leave it half done."""
    before = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOPS}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def cancel_interrupted(run_dir: str, run_id: str, n: int, submitted: list[Any], err: TextIO) -> None:
    """An interrupted launch cancels the local jobs it submitted (``submitted``: submit.Submitted), which
    are this machine's processes. Slurm jobs keep running, as they would after the login shell closed."""
    started = {s.job_id: s.job for s in submitted if s.job is not None}
    lines = cancel_run(run_dir, n, started) if any(s.executor == "local" for s in submitted) else []
    for line in lines:
        err.write(f"  {line}\n")
    slurm = [s for s in submitted if s.executor == "slurm" and s.job_id]
    what = f"{len(lines)} local job(s) of run {run_id} cancelled" if lines else "no local job ran"
    if slurm:
        what += f"; its Slurm jobs keep running (cancel them: python -m orchestrator cancel {run_dir})"
    err.write(f"interrupted: {what}; launch the same run_id again to resume it\n")
