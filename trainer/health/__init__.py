"""Heartbeats and the hang watchdog: a run that stops making progress ends itself instead of burning the
allocation.

Every rank runs one daemon thread (``Monitor``) that

- writes ``{run_dir}/heartbeats/rank_{rank:05d}.json`` every ``heartbeat_interval_s`` (atomic rename of a
  few hundred bytes): iteration, phase, host, pid, rank, wall time of the write and of the last progress.
  The training loop itself does no I/O for this: it only "ticks" (stores a monotonic time and the
  iteration, a few hundred nanoseconds), so heartbeats cost nothing that shows in step time;
- ends the process with ``EXIT_HANG`` (70, :mod:`trainer.signals`) when no tick came for
  ``hang_timeout_s`` once training started, logging the rank, host, last iteration and the idle time,
  and dumping every thread's stack.
  A collective that never returns (a rank died, was stopped, its node fell off the network) blocks the
  others silently for the backend's own timeout (30 min or more, per collective). When the heartbeats show
  every rank alive at the same iteration, the watchdog asks the network which node lost contact
  (trainer/health/contact.py) and names it. The job's retry policy
  (``orchestrator/render.py``: any exit other than 0/65/75 is retried from the last checkpoint) can only
  act once the step exits. The node of the rank the others waited for is named in ``bad_nodes``
  (trainer/health/badnodes.py), so the job's next attempt does not land on it again.

Progress ("ticks") comes from the loop's data iterators (every micro-batch, train and validation), the
end of every step and both ends of every checkpoint save (the loop in ``trainer.run.loop`` calls
``Monitor.tick``): each of one step, one evaluation batch and one save must fit in ``hang_timeout_s``,
however long the evaluation or the time between saves. Saves stay watched because a node whose filesystem
client hangs mid-save is a classic sick node (the others wait at the save's barrier). Start-up
(preflight, dataset index builds, checkpoint loading) is not counted: the watchdog arms with the first
training batch; ranks waiting there for a slow rank are bounded by the process group's own timeout
(``init_distributed``: 30 min).

A backstop covers hangs that hold the GIL (the Python thread could not run): while progress is fresh the
watchdog re-arms ``faulthandler.dump_traceback_later`` at ``hang_timeout_s`` + 60 s, whose C thread dumps
the stacks and exits with code 1 if the Python watchdog never got to act.

``status`` (``python -m orchestrator status``) reads the heartbeats back with ``read_heartbeats``:
a rank whose file stopped changing while its phase is not final is *stale* (process stopped, killed or
its node gone); a fresh file whose progress is old is *stalled* (alive, waiting in a collective).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from trainer.health.badnodes import WATCHDOG, read_bad_nodes, record_bad_nodes  # noqa: F401 (read_bad_nodes: re-exported)
from trainer.health.config import HealthConfig
from trainer.health.contact import lost_contact
from trainer.health.heartbeat import (  # noqa: F401 (re-exported: the package's reading API)
    FINAL_PHASES,
    RankHealth,
    describe_rank,
    heartbeat_path,
    judge,
    node_name,
    read_hangs,
    read_heartbeats,
    record_hang,
    stopped_ranks,
    summarize,
)
from trainer.log import get_logger
from trainer.run_files import RunDir
from trainer.signals import EXIT_HANG

log = get_logger(__name__)

_BACKSTOP_MARGIN_S = 60.0


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Monitor:
    """One rank's heartbeat writer and hang watchdog. A context manager: ``begin`` after the process group
    exists; the training loop (``trainer.run.loop.Loop.monitor``) ticks it on every batch, step and
    save; leaving the block writes a final heartbeat."""

    # The clock progress is measured on. The watchdog tests swap in a virtual one so that "this step took
    # longer than hang_timeout_s" is a fact they set, not a race with a loaded machine's scheduler.
    clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, cfg: HealthConfig, run_dir: str) -> None:
        self.cfg, self.run_dir = cfg, run_dir
        self.rank, self.world_size, self.host, self.pid = 0, 1, node_name(), os.getpid()
        self.iteration: int | None = None
        self.phase = "startup"
        self._last = self.clock()  # clock time of the last tick
        self._started = time.time()
        self._armed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._backstop = False
        # Called after each heartbeat write, from the heartbeat thread (the attempt's goodput record):
        # what a killed process did is on disk up to its last heartbeat. Each must never raise.
        self.writers: list[Callable[[], None]] = []

    # -- the loop's side: cheap, no I/O --------------------------------------------------------------
    def tick(self, iteration: int | None = None, phase: str | None = None, arm: bool = False) -> None:
        """Record progress (called from the training thread)."""
        self._last = self.clock()
        if iteration is not None:
            self.iteration = iteration
        if phase is not None:
            self.phase = phase
        if arm:
            self._armed = True

    # -- the thread's side ----------------------------------------------------------------------------
    def begin(self, device: Any = None) -> None:
        """Start heartbeats (the watchdog arms with the first training batch), then run the preflight
        (``trainer.health.preflight``; multi-rank worlds, unless ``preflight`` is off) with tensors on
        ``device``. Call once the process group (if any) exists. Rank 0 removes heartbeats of ranks
        beyond this world (an earlier, larger attempt of the run)."""
        self.rank, self.world_size = _world()
        RunDir(self.run_dir).heartbeats.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            self._remove_extra_ranks()
        self.write()
        self._thread = threading.Thread(target=self._run, name="slipway-watchdog", daemon=True)
        self._thread.start()
        if self.cfg.preflight and self.world_size > 1:
            import torch

            from trainer.health.preflight import run_preflight

            self.tick(phase="preflight")
            run_preflight(self.cfg, self.run_dir, device if device is not None else torch.device("cpu"))
            self.tick(phase="startup")

    def _remove_extra_ranks(self) -> None:
        folder = RunDir(self.run_dir).heartbeats
        for name in os.listdir(folder):
            stem = name.removeprefix("rank_").removesuffix(".json")
            if stem.isdigit() and int(stem) >= self.world_size:
                try:
                    os.remove(os.path.join(folder, name))
                except OSError:
                    pass

    def record(self, **extra: Any) -> dict:
        """The heartbeat as written now."""
        now_wall, now = time.time(), self.clock()
        return {"rank": self.rank, "world_size": self.world_size, "host": self.host, "pid": self.pid,
                "iteration": self.iteration, "phase": self.phase, "time": now_wall,
                "progress_time": now_wall - (now - self._last), "started": self._started,
                "interval_s": self.cfg.heartbeat_interval_s, "hang_timeout_s": self.cfg.hang_timeout_s,
                "job": os.environ.get("SLURM_JOB_ID"), **extra}

    def write(self, **extra: Any) -> None:
        """Atomically replace this rank's heartbeat file (errors are logged, never raised: a full or slow
        filesystem must not stop training)."""
        path = heartbeat_path(self.run_dir, self.rank)
        tmp = f"{path}.tmp-{self.pid}"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.record(**extra), f)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("could not write heartbeat %s: %s", path, e)

    def _run(self) -> None:
        timeout = self.cfg.hang_timeout_s or 0.0
        period = self.cfg.heartbeat_interval_s
        if timeout:
            period = min(period, max(timeout / 20, 0.05))  # notice a hang within ~5% of the timeout
        next_write = time.monotonic() + self.cfg.heartbeat_interval_s
        while not self._stop.wait(period):
            idle = self.clock() - self._last
            if timeout and self._armed:
                if idle > timeout:
                    self._fire(idle)
                    return
                self._rearm_backstop(timeout)
            now = time.monotonic()  # heartbeat writes are paced in real time, whatever the progress clock
            if now >= next_write:
                self.write()
                for write in self.writers:
                    write()
                next_write = now + self.cfg.heartbeat_interval_s

    def _rearm_backstop(self, timeout: float) -> None:
        # While this thread runs it re-arms the C-level timer; a GIL-holding hang stops it from doing so.
        faulthandler.dump_traceback_later(timeout + _BACKSTOP_MARGIN_S, exit=True)
        self._backstop = True

    def _fire(self, idle: float) -> None:
        faulthandler.dump_traceback_later(30, exit=True)  # if logging itself blocks, still exit
        it = "none yet" if self.iteration is None else str(self.iteration)
        culprits = self._culprits() if self.world_size > 1 else []
        # Every rank alive at the same iteration: a network fault? Ask the network who is cut off.
        cut, look = lost_contact() if self.world_size > 1 and not culprits else ({}, "")
        me = f"rank {self.rank} of {self.world_size} (host {self.host}, pid {self.pid})"
        if self.world_size == 1:
            who = f"stopped progressing: {me} itself. It ends"
        elif culprits:
            who = (f"stopped progressing: {'; '.join(describe_rank(r) for r in culprits)}. This rank, {me}, "
                   "was waiting for it and ends")
        elif cut:
            who = f"{'; '.join(cut.values())} ({look}). This rank, {me}, was waiting for it and ends"
        else:
            who = (f"no heartbeat shows which rank stopped (all alive at the same iteration"
                   f"{'; ' + look if look else ''}). This rank, {me}, ends")
        msg = (f"watchdog: no training progress for {idle:.1f} s (train.hang_timeout_s="
               f"{self.cfg.hang_timeout_s:g}) at iteration {it}, phase {self.phase}; {who} with exit code "
               f"{EXIT_HANG} so the job's retry policy resumes from the last checkpoint; the stacks of all "
               "threads follow.")
        self.phase = "hung"
        self.write(message=msg)
        try:
            record_hang(self.run_dir, {
                "time": time.time(), "job": os.environ.get("SLURM_JOB_ID"), "reporter": self.rank,
                "host": self.host, "iteration": self.iteration, "idle_s": round(idle, 1),
                "stopped": [describe_rank(r) for r in culprits], **({"lost_contact": cut} if cut else {})})
        except OSError as e:
            log.warning("could not record the hang in %s: %s", self.run_dir, e)
        self._name_nodes(culprits, it, cut)
        log.critical(msg)
        for handler in logging.getLogger().handlers + log.handlers:
            handler.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(EXIT_HANG)

    def _name_nodes(self, culprits: list[RankHealth], iteration: str, cut: dict[str, str]) -> None:
        """The culprits' nodes (and those that lost contact), so the job's next attempt keeps them out
        (trainer/health/badnodes.py)."""
        ended = f"rank {self.rank}'s watchdog ended the step"
        nodes: dict[str, str] = {n: f"{why} at iteration {iteration}; {ended}" for n, why in cut.items()}
        for r in culprits:
            if r.host not in ("", "?"):
                nodes.setdefault(r.host, f"rank {r.rank} on {r.host} stopped progressing at iteration "
                                         f"{iteration} ({r.state}); rank {self.rank}'s watchdog ended "
                                         "the step")
        try:
            record_bad_nodes(self.run_dir, nodes, WATCHDOG)
        except OSError as e:
            log.warning("could not record the hang's nodes in %s: %s", self.run_dir, e)

    def _culprits(self) -> list[RankHealth]:
        """The ranks that stopped progressing, from everyone's heartbeats. A heartbeat is stale after three
        intervals (bounded by half the hang timeout, so a rank stopped for the whole timeout is stale)."""
        interval, timeout = self.cfg.heartbeat_interval_s, self.cfg.hang_timeout_s or 0.0
        stale = min(max(3 * interval, 1.0), timeout / 2) if timeout else max(3 * interval, 1.0)
        try:
            beats = read_heartbeats(self.run_dir, stale_after_s=stale)
        except OSError:
            return []
        return stopped_ranks(beats, self.world_size, self.rank)

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            if self._backstop:
                faulthandler.cancel_dump_traceback_later()
            interrupted = exc_type is not None and issubclass(exc_type, KeyboardInterrupt)
            self.phase = "interrupted" if interrupted else "failed" if exc_type is not None else "exited"
            self.write(**({"message": f"{exc_type.__name__}: {exc}"} if exc_type is not None else {}))


