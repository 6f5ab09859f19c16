"""Local jobs (the embedded default's executor): started so that they can be cancelled, and cancelled so that
no process of the run survives.

submitit's LocalExecutor starts each job's controller (``/bin/sh -c '<setup> && python -m
submitit.local._local'``, whose pid is the job id) in the launcher's process group, and its
``LocalJob.cancel`` sends SIGINT to that shell only: the controller and the ranks under it run on. Here:

- :class:`LocalExecutor` starts the controller in a session of its own (``start_new_session``), so every
  process of the job — the controller, the tasks, whatever they start — carries the job id as its session
  id, and a terminal's Ctrl-C reaches only the launcher, which cancels the jobs itself (whatever signal
  reached it: flow.py).
- Its controller is :class:`Controller` (this module run with ``-m``), submitit's own but for what Slurm's
  ``srun --kill-on-bad-exit=1`` does (render.py): submitit's waits until *every* task has exited, so one
  rank that dies — or is stopped (SIGSTOP) and never exits — leaves the others in a collective and the job
  RUNNING until its time limit. Here the first task that fails (an exit other than 0 and submitit's
  requeue code) ends the attempt the way Slurm tears a step down: SIGCONT and SIGTERM to every other
  process of the job's session (a stopped one resumes to take it), SIGKILL to what is left after
  :data:`KILL_WAIT_S` (Slurm's default KillWait; a SIGKILL reaches a stopped process too), and every task
  reaped. How each task ended — its exit code or signal, in the order the controller saw them — goes to
  ``<folder>/<job>_exits.jsonl`` (:data:`trainer.run_files.LOCAL_EXITS`): what srun prints for a Slurm
  step, so that ``status`` names the rank that failed first (orchestrator/readback/culprit.py).
- :func:`cancel` ends a job the way ``scancel`` does, as far as a process tree allows: the controllers
  first (SIGKILL: a controller restarts tasks that exit with the requeue code), then every other process
  of the session or below the job's pid gets SIGINT (Python stops at once; SIGTERM would only ask a
  trainer to save, and submitit's tasks ignore it), and what is left after ``grace_s`` gets SIGKILL.
  Checkpoints are crash-consistent (trainer/checkpoint/protocol.py), so a relaunch resumes from the last
  complete one.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import submitit
from submitit.local.local import LOCAL_REQUEUE_RETURN_CODE, LocalJob, LocalJobEnvironment
from submitit.local.local import Controller as SubmititController

from orchestrator.world.queue import proc_stat, signal_name
from trainer.run_files import LOCAL_EXITS

# The module each job's controller runs as: this one (``python -m``); jobs an older Slipway started run
# submitit's own, and are still found as controllers when cancelled.
_CONTROLLER = __spec__.name if __spec__ is not None else __name__
_CONTROLLERS = (_CONTROLLER, "submitit.local._local")
KILL_WAIT_S = 30.0  # SIGTERM → SIGKILL when a failed attempt is ended (Slurm's default KillWait)
_KILL_WAIT_ENV = "SLIPWAY_LOCAL_KILL_WAIT_S"  # from LocalExecutor.kill_wait_s to its controllers


class LocalExecutor(submitit.LocalExecutor):
    """submitit's LocalExecutor whose job controllers start in their own session and end a failed attempt's
    every process (module docstring)."""

    kill_wait_s: float = KILL_WAIT_S

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
            **{_KILL_WAIT_ENV: str(self.kill_wait_s)},
        )
        controller = shlex.join([sys.executable, "-m", _CONTROLLER, str(self.folder)])
        cmd = " && ".join([*p.get("setup", ()), controller])
        process = subprocess.Popen(cmd, shell=True, env=env, start_new_session=True)
        return LocalJob(folder=self.folder, job_id=str(process.pid), process=process,
                        tasks=list(range(ntasks)))


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, session id) of a live process, None when it is gone or a zombie."""
    stat = proc_stat(pid)
    return None if stat is None or stat[0] in ("Z", "X") else (stat[1], stat[2])


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
    return pid == root or any(c in _cmdline(pid) for c in _CONTROLLERS)


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


class Controller(SubmititController):
    """submitit's local controller, but a failed task ends its attempt as ``srun --kill-on-bad-exit=1``
    ends a step (module docstring), and every task's end is recorded in ``<folder>/<job>_exits.jsonl``."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.kill_wait_s = float(os.environ.get(_KILL_WAIT_ENV, KILL_WAIT_S))
        self.attempt = -1
        self.exits = self.folder / LOCAL_EXITS.format(job=self.pid)
        self._noted: set[int] = set()
        self._teardown: float | None = None  # when the current attempt started to be ended

    def start_tasks(self) -> None:
        self.attempt += 1
        self._noted, self._teardown = set(), None
        super().start_tasks()

    def wait(self, freq: int = 24) -> Sequence[int | None]:
        """submitit's wait (all tasks, the time limit's USR2), ending the attempt once a task failed."""
        assert self.tasks, "Nothing to do!"
        almost_timeout = freq * (self.timeout_s - self.signal_delay_s)
        for step in range(freq * self.timeout_s):
            codes = self._poll()
            if all(c is not None for c in codes):
                return codes
            failed = next((k for k, c in enumerate(codes) if c not in (None, 0, LOCAL_REQUEUE_RETURN_CODE)),
                          None)
            if failed is not None:
                self._end_attempt(failed, codes[failed])
                return self._poll()
            if step == almost_timeout:
                self._forward_signal(LocalJobEnvironment._usr_sig())
            time.sleep(1.0 / freq)
        return self._poll()

    def _poll(self) -> list[int | None]:
        """Every task's exit code (None: running), recording those that ended since the last look."""
        codes = [t.poll() for t in self.tasks]
        for k, code in enumerate(codes):
            if code is not None and k not in self._noted:
                self._noted.add(k)
                record = {"attempt": self.attempt, "task": k, "pid": self.tasks[k].pid, "code": code,
                          "time": time.time(), "after_teardown": self._teardown is not None}
                try:
                    with self.exits.open("a", encoding="utf-8") as f:
                        f.write(json.dumps(record) + "\n")
                except OSError:
                    pass  # a full disk must not keep the attempt's processes alive
        return codes

    def _end_attempt(self, task: int, code: int) -> None:
        """Slurm's step teardown: SIGCONT + SIGTERM to every process of the attempt, SIGKILL after the
        kill wait to what is left, every task reaped."""
        how = f"was killed by {signal_name(-code)}" if code < 0 else f"exited with code {code}"
        self._say(f"slipway: task {task} (pid {self.tasks[task].pid}) {how}: ending the attempt's other "
                  f"processes (SIGTERM, SIGKILL after {self.kill_wait_s:g} s), as srun --kill-on-bad-exit "
                  "does")
        self._teardown = time.time()
        procs = self._attempt_processes()
        _signal(procs, signal.SIGCONT)  # a stopped process takes SIGTERM only once continued
        _signal(procs, signal.SIGTERM)
        deadline = time.monotonic() + self.kill_wait_s
        while self._attempt_processes() and time.monotonic() < deadline:
            self._poll()
            time.sleep(0.05)
        _signal(self._attempt_processes(), signal.SIGKILL)
        for t in self.tasks:
            t.wait()  # reaped: no zombie counts as alive
        self._poll()

    def _attempt_processes(self) -> list[int]:
        """Every live process of this job but the controller and the shell that started it."""
        mine = {os.getpid(), os.getppid()}
        return [p for p in job_processes(int(self.pid)) if p not in mine]

    def _say(self, line: str) -> None:
        """A line in every task's stderr (what srun writes to the batch log)."""
        for f in self.stderrs:
            try:
                f.write(line + "\n")
                f.flush()
            except (OSError, ValueError):
                pass


if __name__ == "__main__":
    # The job's controller (LocalExecutor._submit_command): most arguments come from the environment.
    assert len(sys.argv) == 2, f"usage: python -m {_CONTROLLER} <submitit folder>"
    Controller(Path(sys.argv[1])).run()
