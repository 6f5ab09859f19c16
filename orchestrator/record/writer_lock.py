"""One writer per run: a launch holds a lock on the run directory and on the checkpoint directory while it
records and submits, and refuses when a job of the same run is still queued or running, or when another
run's active job writes the same checkpoint directory (``.slipway-writer.json`` there). Two launches of one
run therefore never write one checkpoint directory at the same time; relaunching a run whose jobs have all
ended resumes it from its checkpoints. Before a new launch, the final job states of the earlier ones are
recorded. The dry run reports the same refusal without the lock (checks/checkpoints.py, active_problems).
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from orchestrator.base.plan_types import Plan
from orchestrator.base.problems import PlanError, Problem
from orchestrator.record import launches
from orchestrator.stages.train import NAME as TRAIN
from orchestrator.world.queue import ended, live_state, local_state, query_slurm
from orchestrator.world.runs import write_json
from trainer.run_files import CKPT_WRITER, LAUNCH_LOCK


def checkpoint_dir(plan: Plan) -> str:
    return plan.stage(TRAIN).job.trainer_config["checkpoint"]["dir"]


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _latest_entries(data: dict[str, Any]) -> list[tuple[int, str, dict[str, Any]]]:
    """(launch, stage, entry) of each launch's last job per stage, except launches whose outcome is
    recorded (their jobs ended)."""
    return [(r.get("n", 1), stage, es[-1]) for r in launches.history(data) if not r.get("outcome")
            for stage, es in r.get("jobs", {}).items() if es]


def active_jobs(plan: Plan, data: dict[str, Any]) -> list[str]:
    """Descriptions of the queued/running jobs of this run (any launch; ``data``: its run.json) and of the
    checkpoint directory's writer."""
    found: list[str] = []
    seen: set[str] = set()
    last = len(launches.history(data))
    for n, stage, e in _latest_entries(data):
        state = live_state(str(e["job_id"]), e.get("executor", "slurm"), e.get("folder"))
        seen.add(str(e["job_id"]))
        if state:
            by = "" if n == last and not e.get("adopted") else f" submitted by launch {n}"
            by += " (which died before recording it)" if e.get("adopted") else ""
            found.append(f"{stage} job {e['job_id']} ({state}){by}")
    writer = _read(Path(checkpoint_dir(plan)) / CKPT_WRITER)
    if writer and str(writer.get("job_id")) not in seen:
        state = live_state(str(writer["job_id"]), writer.get("executor", "slurm"), writer.get("folder"))
        if state:
            found.append(f"train job {writer['job_id']} of run {writer.get('run_dir')} ({state}), which "
                         f"writes {checkpoint_dir(plan)}")
    return found


def run_active(plan: Plan, active: list[str]) -> Problem:
    """The refusal of a second writer: single_writer raises it, the dry run reports it."""
    return Problem(
        "run_active", "run_id", plan.run_id,
        f"this run is already launched: {'; '.join(active)}. A second launch would write "
        f"{checkpoint_dir(plan)} at the same time",
        f"follow it with python -m orchestrator status {plan.run_dir}; to relaunch, wait until it "
        f"ends or cancel it first (python -m orchestrator cancel {plan.run_dir})")


def record_outcomes(record: launches.LaunchRecord) -> None:
    """Before a new launch: the final job states of earlier launches (their jobs have all ended)."""
    data = launches.relocated(record.data, record.run_dir)  # a moved run's results are where it stands
    entries, cancelled = _latest_entries(data), launches.cancelled_ids(data)
    _, sa = query_slurm([str(e["job_id"]) for _, _, e in entries if e.get("executor", "slurm") == "slurm"])
    states = {str(e["job_id"]): local_state(e, str(e["job_id"]) in cancelled) if e.get("executor") == "local"
              else sa.get(str(e["job_id"]), {}).get("state", "UNKNOWN") for _, _, e in entries}
    # a state accounting does not know yet is left out: a later launch records it
    record.add_outcomes({j: st for j, st in states.items() if ended(st)})


@contextmanager
def single_writer(plan: Plan) -> Iterator[launches.LaunchRecord]:
    """Hold the launch locks of the run and checkpoint directories; refuse while another writer is active.
    Yields the run's record, read once under the lock (a damaged one is refused, never taken for empty)."""
    created = [d for d in (checkpoint_dir(plan), plan.run_dir) if not os.path.isdir(d)]
    with ExitStack() as stack:
        for d in sorted({plan.run_dir, checkpoint_dir(plan)}):  # one order everywhere: no deadlock
            os.makedirs(d, exist_ok=True)
            f = stack.enter_context(open(os.path.join(d, LAUNCH_LOCK), "a"))
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            record = launches.LaunchRecord.load(plan.run_dir)
            record.reconcile()  # a dead launch's unrecorded job is recorded first
            active = active_jobs(plan, record.data)
        except RuntimeError as err:  # squeue cannot say whether a dead launch's job is queued
            active = [str(err)]
        if active:
            for d in created:  # a refused launch leaves nothing behind
                Path(d, LAUNCH_LOCK).unlink(missing_ok=True)
                _rmdir(d)
            raise PlanError([run_active(plan, active)])
        if record.data["launches"]:
            record_outcomes(record)
        yield record


def _rmdir(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


def record_writer(plan: Plan, job_id: str | None, executor: str, folder: str | None = None) -> None:
    """Name the training job (and its submitit folder) as the checkpoint directory's writer (read by later
    launches)."""
    if job_id:
        write_json(Path(checkpoint_dir(plan)) / CKPT_WRITER,
                   {"run_id": plan.run_id, "run_dir": plan.run_dir, "job_id": job_id, "executor": executor,
                    "folder": folder})
