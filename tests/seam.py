"""The test seam: the fault plugin (trainer/faults.py) that makes a job misbehave on purpose, loaded by the
product only where ``SLIPWAY_FAULT_PLUGIN=tests.seam`` and the switch ``SLIPWAY_TESTING=1`` are on
(:func:`hook_env` sets both; the plan refuses every hook without the switch). Nothing here runs in a real
job.

- :func:`at`, the fault points: ``SLIPWAY_CKPT_FAILPOINT=<step>@<iteration>`` SIGKILLs the process at that
  step of a checkpoint save (with ``SLIPWAY_CKPT_FAILPOINT_ONCE=<path>`` only the first process to create
  that file, so the retry of a killed job gets past it); ``SLIPWAY_LAUNCH_FAILPOINT=<step>`` SIGKILLs
  launch.py at that step of a submission (``recorded``, ``before_sbatch:<stage>``,
  ``after_sbatch:<stage>``, ``after_record:<stage>``, ``submitted``), as a login shell dying there would;
  ``SLIPWAY_CONVERT_FAILPOINT=<step>`` SIGKILLs the HF conversion at that step (``written``: the model is
  in ``hf.partial``, not verified; ``between_renames``: the old model moved aside, the new one not in);
  ``SLIPWAY_PREFLIGHT_FAILPOINT=stop@NODE`` SIGSTOPs NODE's leader after it checked in, ``slow@NODE:MS``
  delays each of its sends by MS ms (a sick link); every training rank writes ``pids/rank<N>.pid`` (the
  fault tests signal ranks).
- ``SLIPWAY_FAIL_TRAIN=start``: the training stage raises at start (afterok, retries, failure reports);
  ``oom@<rank>:<iteration>``: that rank runs out of memory after that iteration (the real CPU allocator
  refuses an impossible request), as a layout too big for the memory does.
- ``SLIPWAY_FAIL_TRIAL=<i>[:oom|hang],...``: layout=auto's trial ``i`` fails at its iteration 2 on rank 0:
  ``oom`` (the default) raises torch's OutOfMemoryError, as a layout too big for the device does; ``hang``
  stops the rank there for good, as a deadlock would, until the trial's hang watchdog ends it.
- ``SLIPWAY_STALL_TRAIN=N``: after iteration N every rank pauses until a signal arrives or the file
  ``resume_N`` appears beside the stall markers (at most 10 min), so fault tests preempt, time out, kill or
  cut off a job at a known point instead of racing a fast run.
- ``SLIPWAY_CRASH_TRAIN=N,M,...``: after each of those iterations the first rank to get there SIGKILLs
  itself (a marker per iteration makes it once per run: the retry that replays the iteration goes on),
  as a node or process failure would (bench/goodput.py injects its failures so).
- ``SLIPWAY_KERNEL_FAULT=op[:kind],...``: a resolved op made wrong (tests/seam_kernels.py).

The plugin loads no torch itself: the launcher loads it for its failpoints and stays torch-free.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from trainer import faults
from trainer.faults import (
    CKPT_FAILPOINT,
    CKPT_FAILPOINT_ONCE,
    CONVERT_FAILPOINT,
    CRASH_TRAIN,
    FAIL_TRAIN,
    FAIL_TRIAL,
    LAUNCH_FAILPOINT,
    PREFLIGHT_FAILPOINT,
    STALL_TRAIN,
)
from trainer.log import get_logger
from trainer.run_files import RunDir

log = get_logger(__name__)


def hook_env(**hooks: str) -> dict[str, str]:
    """The environment variables that turn hooks on, switch and plugin included:
    ``hook_env(FAIL_TRAIN="start")`` (names as in trainer.faults)."""
    return {faults.SWITCH: "1", faults.PLUGIN: __name__,
            **{getattr(faults, k): str(v) for k, v in hooks.items()}}


@contextlib.contextmanager
def enabled(**hooks: str) -> Iterator[None]:
    """Hooks on in this process's environment (so in every job it launches now), restored after."""
    values = hook_env(**hooks)
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def at(point: str, **where) -> float | None:
    """trainer.faults.at: what the hooks set in this process's environment do at ``point``."""
    kind, _, step = point.partition(":")
    env = os.environ
    if kind == "checkpoint" and env.get(CKPT_FAILPOINT) == f"{step}@{where['iteration']}":
        once = env.get(CKPT_FAILPOINT_ONCE)
        try:
            if once:
                os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return None
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "launch" and env.get(LAUNCH_FAILPOINT) == step:
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "convert" and env.get(CONVERT_FAILPOINT) == step:
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "preflight":
        return _preflight(step, where["node"], env.get(PREFLIGHT_FAILPOINT, ""))
    elif point == "train:start":
        train_stage_start(**where)
    return None


def _preflight(kind: str, node: str, spec: str) -> float:
    """Seconds of delay for 'slow' on this node; stops the process for 'stop' on this node."""
    what, _, arg = spec.partition("@")
    target, _, ms = arg.partition(":")
    if what != kind or target != node:
        return 0.0
    if kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    return float(ms or 0) / 1000.0


def train_stage_start(run_dir: str, rank: int, restart: str, attempt: str) -> None:
    """A training rank starts: it writes ``pids/rank<N>.pid`` (``<pid> <restart> <attempt>``), and with
    ``SLIPWAY_FAIL_TRAIN=start`` the stage fails before the trainer starts."""
    pid_file = RunDir(run_dir).rank_pid(rank)
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    pid_file.write_text(f"{os.getpid()} {restart} {attempt}\n")
    if os.environ.get(FAIL_TRAIN) == "start":
        raise RuntimeError(f"{FAIL_TRAIN}=start: training failed on purpose (test hook)")


def trial_on_step(index: int, rank: int, environ: Mapping[str, str] | None = None
                  ) -> Callable[[int, float], None] | None:
    """The step hook of trial ``index`` under ``SLIPWAY_FAIL_TRIAL`` (None when it names other trials)."""
    value = (os.environ if environ is None else environ).get(FAIL_TRIAL, "")
    kinds = {}
    for item in filter(None, value.split(",")):
        which, _, kind = item.partition(":")
        if not which.isdigit() or kind not in ("", "oom", "hang"):
            raise ValueError(f"{FAIL_TRIAL}={value!r}: expected <trial>[:oom|hang],...; unset it "
                             "(a test hook)")
        kinds[int(which)] = kind
    if index not in kinds or rank != 0:
        return None
    kind = kinds[index]

    def on_step(iteration: int, loss: float) -> None:
        if iteration != 2:
            return
        log.warning("%s=%s (test hook): trial %d fails on purpose", FAIL_TRIAL, value, index)
        if kind == "hang":
            threading.Event().wait()  # for good: the trial's watchdog ends the process
        import torch

        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB ({FAIL_TRIAL} test "
                                     "hook)")

    return on_step


def train_on_step(marker_dir: str, rank: int, environ: Mapping[str, str] | None = None
                  ) -> Callable[[int, float], None] | None:
    """The trainer's ``on_step`` hook for ``SLIPWAY_STALL_TRAIN``, ``SLIPWAY_FAIL_TRAIN=oom@R:N`` and
    ``SLIPWAY_CRASH_TRAIN`` (None when none is set)."""
    env = os.environ if environ is None else environ
    value = env.get(STALL_TRAIN)
    hooks = [h for h in (stall_hook(int(value), marker_dir, rank) if value else None,
                         oom_hook(env.get(FAIL_TRAIN, ""), rank),
                         crash_hook(env[CRASH_TRAIN], marker_dir) if env.get(CRASH_TRAIN) else None)
             if h is not None]
    if not hooks:
        return None

    def on_step(iteration: int, loss: float) -> None:
        for hook in hooks:
            hook(iteration, loss)

    return on_step


def oom_hook(value: str, rank: int) -> Callable[[int, float], None] | None:
    """``SLIPWAY_FAIL_TRAIN=oom@<rank>:<iteration>``: after that iteration that rank asks the real CPU
    allocator for 4 EiB, which refuses as it does when memory runs out ("DefaultCPUAllocator: can't
    allocate memory"), without exhausting this machine's memory; None for other ranks and values."""
    what, _, where = value.partition("@")
    if what != "oom":
        return None
    target, _, at = where.partition(":")
    if not (target.isdigit() and at.isdigit()):
        raise ValueError(f"{FAIL_TRAIN}={value!r}: expected start or oom@<rank>:<iteration>; unset it "
                         "(a test hook)")
    if int(target) != rank:
        return None

    def on_step(iteration: int, loss: float) -> None:
        if iteration == int(at):
            log.warning("%s=%s (test hook): rank %d runs out of memory on purpose", FAIL_TRAIN, value, rank)
            import torch

            torch.empty(1 << 62, dtype=torch.uint8)

    return on_step


def crash_hook(value: str, marker_dir: str) -> Callable[[int, float], None]:
    """``on_step`` of ``SLIPWAY_CRASH_TRAIN``: after each listed iteration, the rank that creates the marker
    ``crashed_<iteration>`` first SIGKILLs itself (once per run; the others die with it by srun's
    --kill-on-bad-exit, or hang in a collective until they do)."""
    try:
        iterations = {int(x) for x in value.split(",") if x.strip()}
    except ValueError:
        raise ValueError(f"{CRASH_TRAIN}={value!r}: expected <iteration>,...; unset it (a test hook)"
                         ) from None

    def on_step(it: int, loss: float) -> None:
        if it not in iterations:
            return
        marker = Path(marker_dir) / f"crashed_{it}"
        marker.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        log.warning("%s=%s (test hook): SIGKILL after iteration %d", CRASH_TRAIN, value, it)
        os.kill(os.getpid(), signal.SIGKILL)

    return on_step


def _wakeup_pipe() -> int:
    """A pipe that receives a byte for every signal handled in Python (read end returned)."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    return r


def stall_hook(iteration: int, marker_dir: str, rank: int, max_s: float = 600.0
               ) -> Callable[[int, float], None]:
    """``on_step`` callback of the ``SLIPWAY_STALL_TRAIN`` test hook: after ``iteration`` the rank pauses
    until a signal arrives (Slurm's time-limit USR2, a preemption, srun's kill after another rank died),
    the file ``resume_<iteration>`` appears in ``marker_dir`` (the test's go: training goes on as if
    nothing happened) or ``max_s`` passes, so fault tests act at a known iteration instead of racing a fast
    run. The wait wakes on any signal that has a Python handler (``signal.set_wakeup_fd``); the trainer's
    own handler then stops the run at this step boundary.

    Call it in the main thread before the trainer starts, so a signal that comes early is not missed.
    The marker ``stalled_<iteration>_rank<rank>`` (written when the pause starts) makes it once per run:
    a retry that replays the iteration passes through, and tests watch for it.
    """
    wake = _wakeup_pipe()
    marker = Path(marker_dir) / f"stalled_{iteration}_rank{rank}"

    def on_step(it: int, loss: float) -> None:
        if it != iteration or marker.exists():
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{time.time()}\n")
        log.warning("%s=%d (test hook): pausing until a signal arrives", STALL_TRAIN, iteration)
        go, deadline, ready = Path(marker_dir) / f"resume_{iteration}", time.monotonic() + max_s, []
        while not ready and not go.exists() and time.monotonic() < deadline:
            ready, _, _ = select.select([wake], [], [], 0.1)
        why = "signal received" if ready else f"{go.name} found" if go.exists() else "no signal"
        log.warning(f"{STALL_TRAIN}: %s, continuing", why)

    return on_step


def inject(kernels, environ: Mapping[str, str]):
    """trainer.faults.with_faults: the kernel set made wrong (tests/seam_kernels.py, loaded only here, so a
    launcher that loads this plugin does not load torch)."""
    from tests.seam_kernels import inject as wrong

    return wrong(kernels, environ)
