"""Graceful stop: SIGUSR2/SIGTERM set a flag; the training loop acts on it at a step boundary.

Why a flag and not work in the handler: the signal can arrive in the middle of a collective, a backward
pass or a checkpoint write. The handler only records it; at the next step boundary all ranks all-reduce
their flags (a signal delivered to one rank stops them all, in the same iteration), save a checkpoint and
exit with ``EXIT_REQUEUE``. Further signals during the save only set the flag again, so they cannot
interrupt (and corrupt) the save. SIGUSR2 is what Slipway's sbatch scripts ask Slurm to send before the
time limit (``--signal=USR2@lead``; USR1 may be taken by NCCL); SIGTERM is what preemption and
``scancel`` send.

Exit codes (the contract with the orchestrator and with ``python -m trainer.run``):
- ``EXIT_OK`` (0): the run reached ``train.iters`` (final checkpoint saved).
- ``EXIT_REQUEUE`` (75, sysexits' EX_TEMPFAIL): stopped cleanly on a signal after saving a complete
  checkpoint; requeue the job and it resumes exactly.
- ``EXIT_NONFINITE`` (65, EX_DATAERR): the loss or gradient norm became NaN/inf in bf16/fp32; the step was
  not applied, nothing was saved, the last good checkpoint is intact. Retrying would repeat it: do not
  requeue blindly.
- ``EXIT_PERMANENT`` (78, EX_CONFIG): a failure a retry would repeat (:func:`permanent_reason`: no
  checkpoint verifies or fits the model, the disk is full, the data or an input file is missing or
  corrupt, a bad configuration value, a W&B problem at start-up, a rank out of memory — the layout's
  memory need is the same on every attempt: :func:`out_of_memory`). Not retried; the reason is in the log
  and in the stage's ``fatal_<job>_r<restart>_a<attempt>`` marker.
- ``EXIT_HANG`` (70, EX_SOFTWARE): the hang watchdog (:mod:`trainer.health`) ended a rank that made no
  progress for ``health.hang_timeout_s``. Not 0/65/75/78, so the sbatch script retries it from the last
  checkpoint.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable

from trainer.log import get_logger

log = get_logger(__name__)

EXIT_OK = 0
EXIT_REQUEUE = 75
EXIT_NONFINITE = 65
EXIT_PERMANENT = 78
EXIT_HANG = 70
# Errors a retry in the same allocation would repeat. Deliberately narrow: RuntimeError (collectives, NCCL,
# CUDA) and OSError other than a missing file can be a sick node, and those are retried.
_PERMANENT = (ValueError, KeyError, TypeError, FileNotFoundError)
# By name, so that this module stays free of torch: checkpoint errors (damaged beyond fallback, another
# model, a full disk) and W&B errors (no key, unreachable under logging.wandb.require_online; a monitoring
# tool must never cost the allocation the retries of a training failure).
_PERMANENT_NAMES = {"CheckpointError", "WandbError"}
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


# How the allocators say it (by text: this module stays free of torch). CUDA's caching allocator raises
# torch.OutOfMemoryError ("CUDA out of memory. Tried to allocate ..."); the CPU allocator a RuntimeError
# ("[enforce fail at alloc_cpu.cpp:...] ... DefaultCPUAllocator: can't allocate memory: you tried to
# allocate N bytes"), measured with torch 2.13; ROCm's HIP allocator "HIP out of memory".
_OOM_NAMES = {"OutOfMemoryError"}
_OOM_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory")


def out_of_memory(exc: BaseException) -> str | None:
    """The allocator's own line when ``exc`` says a device or the host ran out of memory, else None.

    Deterministic for a layout: the same model, micro-batch and parallel layout need the same memory on
    every attempt, so a retry repeats it (the fix is a smaller micro-batch, activation recomputation or
    more pipeline stages: trainer/run/entry.py names them)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    names = {c.__name__ for c in type(exc).__mro__}
    hit = next((line for line in lines if any(t in line.lower() for t in _OOM_TEXT)), None)
    if names & _OOM_NAMES or hit is not None:
        text = hit or (lines[0] if lines else "")
        return text[text.index("DefaultCPUAllocator"):] if "DefaultCPUAllocator" in text else text
    return None


def permanent_reason(exc: BaseException) -> str | None:
    """Why ``exc`` will repeat on a retry (a one-line reason), or None when a retry may succeed."""
    names = {c.__name__ for c in type(exc).__mro__}
    if isinstance(exc, _PERMANENT) or names & _PERMANENT_NAMES or out_of_memory(exc) is not None:
        return f"{type(exc).__name__}: {exc}"
    return None


class StopRequest:
    """Installs handlers for ``signals`` (main thread only) and remembers which arrived.

    Use as a context manager: the previous handlers are restored on exit.
    """

    def __init__(self, signals: Iterable[int] = STOP_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return bool(self.received)

    def _handle(self, signum: int, frame: object) -> None:
        # Only record: logging or I/O here could interleave with whatever the signal interrupted.
        self.received.append(signum)

    def install(self) -> StopRequest:
        if threading.current_thread() is not threading.main_thread():
            log.warning("not in the main thread: stop signals are not handled by the trainer")
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def describe(self) -> str:
        names = [signal.Signals(s).name for s in self.received]
        return ", ".join(names) if names else "none"

    def __enter__(self) -> StopRequest:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
