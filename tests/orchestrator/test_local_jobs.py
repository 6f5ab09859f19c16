"""The local executor's controller ends a failed attempt the way Slurm tears a step down
(orchestrator/world/local_jobs.py): once one task fails, every other process of the job — a task stopped
with SIGSTOP, a task that ignores SIGTERM, a process a task started — is ended and reaped, the job ends,
and how each task ended is recorded in the order the controller saw it. Real processes, no training: three
tasks of a submitit job that do exactly that."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import submitit

from orchestrator.readback.culprit import local_ends
from orchestrator.world import local_jobs
from orchestrator.world.queue import local_state, proc_stat, process_alive, read_exits
from tests.orchestrator.conftest import REPO
from tests.waits import NEVER_S, wait_until
from trainer.run_files import SUBMITIT_LOG

_IGNORES_SIGTERM = ("import signal, sys, time; from pathlib import Path; "
                    "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                    "Path(sys.argv[1]).write_text(str(__import__('os').getpid())); time.sleep(600)")


def _stopped(pid_file: Path) -> bool:
    """The process named in ``pid_file`` is stopped (SIGSTOP: state T)."""
    if not pid_file.exists():
        return False
    stat = proc_stat(int(pid_file.read_text()))
    return stat is not None and stat[0] == "T"


def behave(shared: str) -> None:
    """Task 1 stops itself and never exits on its own; task 2 starts a process that ignores SIGTERM and
    waits forever; task 0 fails once both are in place."""
    rank, here = submitit.JobEnvironment().global_rank, Path(shared)
    if rank == 1:
        (here / "stopping").write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        threading.Event().wait()  # continued (SIGCONT): it still never ends by itself
    elif rank == 2:
        subprocess.Popen([sys.executable, "-c", _IGNORES_SIGTERM, str(here / "grandchild")])
        threading.Event().wait()
    wait_until(lambda: _stopped(here / "stopping") and (here / "grandchild").exists(),
               "task 1 stopped and task 2's process started")
    raise RuntimeError("task 0 fails on purpose")


def test_a_failed_task_ends_every_process_of_the_attempt_even_a_stopped_one(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    ex = local_jobs.LocalExecutor(tmp_path / "job")
    ex.kill_wait_s = 2.0  # SIGTERM → SIGKILL (Slurm's KillWait; 30 s in a real job)
    ex.update_parameters(tasks_per_node=3, timeout_min=30, setup=[f"export PYTHONPATH={REPO}"])
    job = ex.submit(behave, str(shared))
    pids: set[int] = set()
    try:
        wait_until(lambda: (shared / "grandchild").exists() and _stopped(shared / "stopping"),
                   "the stopped task and the grandchild")
        pids = {int((shared / n).read_text()) for n in ("stopping", "grandchild")}
        pids |= set(local_jobs.job_processes(job.job_id))
        wait_until(job.done, "the job to end (it waits for no stopped task)", NEVER_S)
        assert not [p for p in pids if process_alive(p)], "a process of the failed attempt survived"
        assert local_jobs.job_processes(job.job_id) == []

        ends = read_exits(tmp_path / "job", job.job_id)
        assert [(e["task"], e["code"], e["after_teardown"]) for e in ends][0] == (0, 1, False), ends
        assert sorted(e["task"] for e in ends) == [0, 1, 2]
        assert all(e["code"] < 0 and e["after_teardown"] for e in ends[1:]), ends  # killed by the teardown
        assert [(e.rank, e.after_teardown) for e in local_ends(str(tmp_path / "job"), job.job_id)][0] == \
            (0, False)
        log = (tmp_path / "job" / SUBMITIT_LOG.format(job=job.job_id, task=1, stream="err")).read_text()
        assert f"slipway: task 0 (pid {ends[0]['pid']}) exited with code 1: ending the attempt's other " \
               "processes (SIGTERM, SIGKILL after 2 s)" in log, log
        entry = {"job_id": job.job_id, "folder": str(tmp_path / "job"), "state_dir": str(tmp_path / "state")}
        assert local_state(entry) == "FAILED"
    finally:
        for p in pids:
            if process_alive(p):
                os.kill(p, signal.SIGKILL)
        if job._process is not None and job._process.poll() is None:
            job._process.kill()
            job._process.wait()
