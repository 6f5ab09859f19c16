"""The run's checkpoints: what a save holds in each format, written synchronously or in the background
(``checkpoint.async_save``: trainer.checkpoint.background), and what each save cost training (the
attempt's goodput clock).

A save first waits for the one in flight (one background save per rank at a time; its error, if it
failed, is raised here on every rank). The save before a stop and the last one of the run (``final``) are
waited for before the run goes on to exit; with ``async_save`` they are still written by the background
path, so every checkpoint of such a run comes from the same code (and, reusing the host buffers, costs
only the copy on top of the write).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from trainer.checkpoint import protocol as ckpt
from trainer.checkpoint.background import Writer, checkpoint_group, start_dist_save, start_shard_save
from trainer.checkpoint.dist_write import save_dist_checkpoint
from trainer.checkpoint.space import state_bytes
from trainer.checkpoint.staging import HostStager
from trainer.config import CheckpointConfig, ModelConfig
from trainer.goodput import AttemptClock
from trainer.log import get_logger
from trainer.parallel import ParallelModel
from trainer.restore.dist import dist_content
from trainer.restore.distrib_optim import extra_files
from trainer.restore.state import Restorable, RunFacts, TrainState, build_state, checkpoint_args

log = get_logger(__name__)


@dataclass
class Saver:
    """``saver(state)`` saves ``state.iteration`` (collective: every rank calls it at the same iteration);
    ``saver(state, final=True)`` returns once it is committed. Built on every rank at the same point (the
    background writer's group is a collective)."""

    cfg: CheckpointConfig
    gpt: ModelConfig
    model: ParallelModel
    parts: Restorable
    facts: RunFacts
    clock: AttemptClock | None = None
    writer: Writer | None = field(init=False, default=None)
    stager: HostStager = field(init=False, default_factory=HostStager)
    _entry: dict | None = field(init=False, default=None)  # the clock's entry of the save in flight

    def __post_init__(self) -> None:
        ps = self.model.pstate
        self.layout = ckpt.ShardLayout(ps.tp_rank, ps.pp_rank, ps.tp_size, ps.pp_size, ps.dp_rank, ps.dp_size)
        if self.cfg.async_save:
            self.writer = Writer(checkpoint_group())

    def __call__(self, state: TrainState, final: bool = False) -> None:
        t0 = time.monotonic()
        self.wait()  # a second save waits for the one in flight (and raises its error)
        background = self.writer is not None
        args = checkpoint_args(self.gpt, self.model, self.facts, state)
        if self.cfg.format == "torch_dist":
            content = dist_content(self.model, self.parts, args, state, self.facts.config)
            entry = self._started(state.iteration, background, content)
            if background:
                start_dist_save(self.writer, self.stager, self.cfg.dir, state.iteration, content, self.layout,
                                self.cfg.keep, self._done(entry, state.iteration))
            else:
                save_dist_checkpoint(self.cfg.dir, state.iteration, *content, self.layout, self.cfg.keep)
        else:
            shard = build_state(self.model, self.parts, args, state, self.facts.config)
            files = {ckpt.SHARD_FILE: shard, **extra_files(self.parts.optimizer)}  # collective over dp
            entry = self._started(state.iteration, background, files)
            if background:
                start_shard_save(self.writer, self.stager, self.cfg.dir, state.iteration, files, self.layout,
                                 self.cfg.keep, self._done(entry, state.iteration))
            else:
                ckpt.save_checkpoint(self.cfg.dir, state.iteration, files.pop(ckpt.SHARD_FILE), self.layout,
                                     self.cfg.keep, files)
        started = time.monotonic() - t0
        if final:
            self.wait()
        blocked = time.monotonic() - t0
        self._entry = entry
        if self.clock is not None and entry is not None:
            self.clock.save_blocked(entry, blocked)
            if not background:
                self.clock.save_written(entry, blocked)
        if background and not final:
            log.info("checkpoint of iteration %d: started in %.2f s; its host copy and files are made in "
                     "the background", state.iteration, started)

    def _started(self, iteration: int, background: bool, content) -> dict | None:
        if self.clock is None:
            return None
        mine = content if self.layout.writes else {}
        return self.clock.save_started(iteration, "async" if background else "sync", state_bytes(mine))

    def _done(self, entry: dict | None, iteration: int):
        def done(seconds: float) -> None:  # the writer thread, once the checkpoint is committed
            log.info("checkpoint of iteration %d committed: written in the background in %.2f s",
                     iteration, seconds)
            if self.clock is not None and entry is not None:
                self.clock.save_written(entry, seconds)
                self.clock.write()

        return done

    def before_update(self) -> None:
        """Before the optimizer changes the parameters and its state: wait for the host copy of the save
        in flight, the time counted as that save's (the loop's clock counts it as checkpoint time)."""
        if self.writer is None or not self.writer.copying():
            return
        waited = self.writer.before_update()
        if self.clock is not None and self._entry is not None:
            self.clock.save_blocked(self._entry, waited)
        log.info("training waited %.2f s for the host copy of the checkpoint in flight", waited)

    def copying(self) -> bool:
        return self.writer is not None and self.writer.copying()

    def failed(self) -> bool:
        """The background save in flight has failed (the loop agrees on it with the stop flag)."""
        return self.writer is not None and self.writer.failed()

    def wait(self) -> float:
        """Wait for the save in flight (seconds waited); raises its error."""
        return self.writer.wait() if self.writer is not None else 0.0

    def settle(self) -> None:
        """At the end of the run, however it ends: wait for the save in flight. Its error is raised when
        the run is otherwise ending cleanly, logged when another error is already on its way out."""
        if sys.exc_info()[1] is None:
            self.wait()
            return
        try:
            self.wait()
        except Exception as e:  # noqa: BLE001 - the error already propagating is the one to report
            log.error("the background checkpoint in flight also failed: %s", e)
