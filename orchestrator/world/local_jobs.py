"""Local jobs (the embedded default's executor): started so that they can be cancelled, and cancelled so that
no process of the run survives.

submitit's LocalExecutor starts each job's controller (``/bin/sh -c '<setup> && python -m
submitit.local._local'``, whose pid is the job id) in the launcher's process group, and its
``LocalJob.cancel`` sends SIGINT to that shell only: the controller and the ranks under it run on. Here:

- :class:`LocalExecutor` starts the controller in a session of its own (``start_new_session``), so every
  process of the job — the controller, the tasks, whatever they start — carries the job id as its session
  id, and a terminal's Ctrl-C reaches only the launcher, which cancels the jobs itself (whatever signal
  reached it: flow.py).
- :func:`cancel` ends a job the way ``scancel`` does, as far as a process tree allows: the controllers
  first (SIGKILL: a controller restarts tasks that exit with the requeue code), then every other process
  of the session or below the job's pid gets SIGINT (Python stops at once; SIGTERM would only ask a
  trainer to save, and submitit's tasks ignore it), and what is left after ``grace_s`` gets SIGKILL.
  Checkpoints are crash-consistent (trainer/checkpoint/protocol.py), so a relaunch resumes from the last
  complete one.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import submitit
from submitit.local.local import LocalJob

_CONTROLLER = "submitit.local._local"  # the module submitit's controller runs as


class LocalExecutor(submitit.LocalExecutor):
    """submitit's LocalExecutor whose job controllers start in their own session (module docstring)."""

    def _submit_command(self, command: str) -> LocalJob:
        # submitit's own _submit_command and start_controller, but for start_new_session=True.
        p = self.parameters
        ntasks = p.get("tasks_per_node", 1)
        gpus = range(p.get("gpus_per_node", 0))
        env = dict(os.environ)
        env.update(
            SUBMITIT_LOCAL_NTASKS=str(ntasks), SUBMITIT_LOCAL_COMMAND=command,
            SUBMITIT_LOCAL_TIMEOUT_S=str(int(60 * p.get("timeout_min", 2.0))),
            SUBMITIT_LOCAL_SIGNAL_DELAY_S=str(int(p.get("signal_delay_s", 30))),
            SUBMITIT_LOCAL_NODEID="0", SUBMITIT_LOCAL_JOB_NUM_NODES="1",
            SUBMITIT_STDERR_TO_STDOUT="1" if p.get("stderr_to_stdout", False) else "",
            SUBMITIT_EXECUTOR="local", CUDA_VISIBLE_DEVICES=",".join(str(k) for k in gpus),
            SUBMITIT_LOCAL_WITH_SHELL="1",  # the controller names its job by its parent, the shell
        )
        controller = shlex.join([sys.executable, "-m", _CONTROLLER, str(self.folder)])
        cmd = " && ".join([*p.get("setup", ()), controller])
        process = subprocess.Popen(cmd, shell=True, env=env, start_new_session=True)
        return LocalJob(folder=self.folder, job_id=str(process.pid), process=process,
                        tasks=list(range(ntasks)))


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, session id) of a live process, None when it is gone or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    return None if fields[0] in ("Z", "X") else (int(fields[1]), int(fields[3]))


def _processes() -> dict[int, tuple[int, int]]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None:
            out[int(entry)] = st
    return out


def job_processes(job_id: str | int) -> list[int]:
    """Every live process of a local job: those in the session it started and those below its pid."""
    root = int(job_id)
    procs = _processes()
    found = {pid for pid, (_, sid) in procs.items() if sid == root}
    if root in procs:
        found.add(root)
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    todo = [root, *found]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return sorted(found)


def _is_controller(pid: int, root: int) -> bool:
    return pid == root or _CONTROLLER in _cmdline(pid)


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def cancel(job_id: str | int, folder: str, grace_s: float = 10.0, job: Any = None) -> list[int]:
    """End every process of local job ``job_id`` (module docstring); returns the pids it signalled, none
    when no process of it names its submitit ``folder`` (the job ended, and its pid may be another
    program's now). ``job``: the submitit job object when this process started it, reaped (no zombie)."""
    root = int(job_id)
    pids = job_processes(root)
    if not any(folder in _cmdline(p) for p in pids):
        return []
    _signal([p for p in pids if _is_controller(p, root)], signal.SIGKILL)
    _signal([p for p in pids if not _is_controller(p, root)], signal.SIGINT)
    deadline = time.monotonic() + grace_s
    while (left := [p for p in pids if _stat(p) is not None]) and time.monotonic() < deadline:
        _reap(job)
        time.sleep(0.1)
    _signal(left, signal.SIGKILL)
    _signal(job_processes(root), signal.SIGKILL)  # anything started in the meantime
    _reap(job)
    return pids


def _reap(job: Any) -> None:
    process = getattr(job, "_process", None)
    if process is not None:
        process.poll()
