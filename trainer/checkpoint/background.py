"""Asynchronous checkpoints (``checkpoint.async_save``): the training ranks block at most while their state
is copied to host memory (:mod:`trainer.checkpoint.staging`: a background thread per rank makes the copy
while training runs the next step's forward and backward, and training waits for it only before its next
optimizer update, :meth:`Writer.before_update`); the same thread then writes it and runs the rest of the
save protocol (:mod:`trainer.checkpoint.protocol`'s numbered steps, unchanged):

1. this rank writes its files from the host copy (fsynced, renamed into place as a synchronous save does;
   torch_dist: ``torch.distributed.checkpoint.async_save``, whose own thread writes the data files);
2. every rank's thread reports whether its write succeeded, in an all-reduce on the *checkpoint group*
   (a gloo group over the world used by nothing else: its collectives run beside the training's, on
   their own connections, so they can neither deadlock with nor reorder the training collectives,
   gloo or NCCL);
3. if every rank succeeded, global rank 0 commits (manifest, tracker, prune) and a second all-reduce tells
   every rank the outcome. So the tracker moves only once every rank's files are complete and fsynced,
   and a crash at any point of the background work leaves it on the previous complete checkpoint.

A thread, not a process: the work is file I/O and hashing, which release the GIL (``torch.save`` writes
each storage's bytes from C++, ``hashlib`` and ``os.fsync`` drop the GIL on large buffers); the pickling
that holds it is the small non-tensor part. A process would need the host copy in shared memory and a
second CUDA/gloo context for no gain (bench/goodput.py measures the step time during a write).

Only one save is in flight per rank: :meth:`Writer.wait` (the next save, the final one, the end of the run)
joins it and raises its error on every rank alike. A failed background save is also seen by the loop at
the next step boundary (:meth:`Writer.failed`, agreed over the ranks with the stop flag), so every rank
raises at the same step.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from trainer import faults
from trainer.checkpoint import dist_write
from trainer.checkpoint import protocol as ckpt
from trainer.checkpoint import verify as ckpt_verify
from trainer.checkpoint.dist_write import Piece
from trainer.checkpoint.files import CheckpointError, CheckpointSpaceError
from trainer.checkpoint.staging import HostCopy, HostStager
from trainer.disk import out_of_space
from trainer.log import get_logger

log = get_logger(__name__)

OK, FAILED, NO_SPACE = 0, 1, 2  # a rank's outcome; the all-reduce keeps the worst


def checkpoint_group() -> dist.ProcessGroup | None:
    """The checkpoint group (module doc): a new gloo group over the world. Collective: every rank calls it
    once, at the same point. None in a world of one (nothing to agree with)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo")


def agree(status: int, group: dist.ProcessGroup | None) -> int:
    """The worst ``status`` of all ranks (a MAX all-reduce of a CPU tensor on ``group``)."""
    if group is None:
        return status
    t = torch.tensor([status], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def _status(error: BaseException | None) -> int:
    if error is None:
        return OK
    return NO_SPACE if isinstance(error, CheckpointSpaceError) else FAILED


def write_then_commit(write: Callable[[], None], commit: Callable[[], None], iteration: int,
                      group: dist.ProcessGroup | None, discard: Callable[[], None] | None = None) -> None:
    """Steps 1-3 (module doc) on this rank's thread. ``commit`` runs on global rank 0 only, ``discard``
    there too when the save failed (a shared temporary folder). Raises on every rank when any rank's write,
    or the commit, failed: this rank's own error, else one that names the iteration."""
    own: BaseException | None = None
    try:
        write()
    except Exception as e:  # noqa: BLE001 - reported to every rank, then raised
        own = e
    status = agree(_status(own), group)
    rank0 = (dist.get_rank() if dist.is_available() and dist.is_initialized() else 0) == 0
    if rank0:
        try:
            if status == OK:
                commit()
            elif discard is not None:
                discard()
        except Exception as e:  # noqa: BLE001
            own = own or e
    status = agree(max(status, _status(own)), group)
    if own is not None:
        raise own
    if status != OK:
        kind = CheckpointSpaceError if status == NO_SPACE else CheckpointError
        raise kind(f"the checkpoint of iteration {iteration} was not committed: another rank's background "
                   f"write {'ran out of space' if status == NO_SPACE else 'failed'} (its log says why); the "
                   "latest checkpoint is unchanged")


class Writer:
    """This rank's background save: at most one job in flight."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._copy: HostCopy | None = None

    def start(self, iteration: int, job: Callable[[], None], on_done: Callable[[float], None],
              copy: HostCopy | None = None) -> None:
        """Run ``job`` (the format's write_then_commit, which begins by making ``copy``) in the background;
        ``on_done(seconds)`` after it succeeded, from that thread."""
        if self._thread is not None:
            raise RuntimeError("a background checkpoint is still in flight: wait() for it first")
        self._error = None
        self._done.clear()
        self._copy = copy

        def run() -> None:
            t0 = time.monotonic()
            try:
                job()
                on_done(time.monotonic() - t0)
            except BaseException as e:  # noqa: BLE001 - raised in the training thread by wait()
                self._error = e
                log.error("background checkpoint of iteration %d failed: %s", iteration, e)
            finally:
                self._done.set()

        self._thread = threading.Thread(target=run, name=f"slipway-ckpt-{iteration}", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def copying(self) -> bool:
        """The host copy of the save in flight is not made yet (training must not update the state)."""
        return self._copy is not None and not self._copy.done()

    def before_update(self) -> float:
        """Where training waits, before it changes the parameters or the optimizer's state, for the host
        copy of the save in flight (the seconds waited; 0 when it is made, or there is none)."""
        return self._copy.wait() if self._copy is not None else 0.0

    def failed(self) -> bool:
        """The job in flight has ended with an error (raised by the next :meth:`wait`)."""
        return self._thread is not None and self._done.is_set() and self._error is not None

    def wait(self) -> float:
        """Join the job in flight (if any); returns the seconds waited, raises the job's error."""
        if self._thread is None:
            return 0.0
        t0 = time.monotonic()
        self._thread.join()
        self._thread, error, self._error, self._copy = None, self._error, None, None
        if error is not None:
            raise error
        return time.monotonic() - t0


# ------------------------------------------------------------------------------- the formats' saves

def start_shard_save(w: Writer, stager: HostStager, ckpt_dir: str, iteration: int, files: dict[str, Any],
                     layout: ckpt.ShardLayout, keep: int | None, on_done: Callable[[float], None]) -> bool:
    """The asynchronous :func:`protocol.save_checkpoint` (``files``: the shard first, then any file
    written beside it). Collective; blocks for the space check; the host copy is made by the writer
    thread while training goes on (:meth:`Writer.before_update`). False: the iteration was already
    committed (nothing written)."""
    if ckpt.already_committed(ckpt_dir, iteration):
        return False
    ckpt.check_space(ckpt_dir, iteration, files, layout)
    copy = stager.prepare(files) if layout.writes else None
    w.start(iteration, lambda: write_then_commit(
        lambda: ckpt.write_files(ckpt_dir, iteration, copy.run() if copy else {}, layout),
        lambda: ckpt.commit(ckpt_dir, iteration, layout, keep), iteration, w.group,
        discard=lambda: _discard_uncommitted(ckpt_dir, iteration)), on_done, copy)
    return True


def _discard_uncommitted(ckpt_dir: str, iteration: int) -> None:
    """The shards the other ranks did write of a save that failed (never committed: removed)."""
    path = ckpt.iter_path(ckpt_dir, iteration)
    if ckpt.read_tracker(ckpt_dir) != iteration and os.path.isdir(path):
        ckpt._remove_aside(path)


def _dcp_out_of_space(err: BaseException) -> bool:
    """A full disk, also inside torch.distributed.checkpoint's per-rank failures."""
    failures = getattr(err, "failures", None) or {}
    return out_of_space(err) or any(out_of_space(getattr(f, "exc", None)) for f in failures.values())


def start_dist_save(w: Writer, stager: HostStager, ckpt_dir: str, iteration: int,
                    content: tuple[list[Piece], dict], layout: ckpt.ShardLayout, keep: int | None,
                    on_done: Callable[[float], None]) -> bool:
    """The asynchronous :func:`dist_write.save_dist_checkpoint` (``content``: this rank's pieces and rank
    0's common state). Collective; blocks for the space check and the shared folder. The writer thread
    makes the host copy (training goes on: :meth:`Writer.before_update`), then
    ``torch.distributed.checkpoint.async_save`` writes the data files and ``.metadata`` from it in its own
    thread (its collectives on the checkpoint group), then this rank's thread hashes them, rank 0 adds
    ``common.pt``, and the protocol's steps 2-3 follow."""
    pieces, common = content
    if ckpt.already_committed(ckpt_dir, iteration):
        return False
    rank0 = ckpt.global_rank() == 0
    mine = {"pieces": [p.data for p in pieces], "common": common if rank0 else {}}
    ckpt.check_space(ckpt_dir, iteration, mine, layout)
    tmp = dist_write.shared_tmp(ckpt_dir, iteration)
    copy = stager.prepare(mine)

    def write() -> None:
        staged = copy.run()
        host = [dataclasses.replace(p, data=d) for p, d in zip(pieces, staged["pieces"], strict=True)]
        faults.at("checkpoint:before_write", iteration=iteration)
        try:
            dist_write.start_pieces(tmp, host, pieces, w.group).result()
            written = dist_write.own_files(tmp)
            if rank0:
                dist_write.write_common(tmp, staged["common"])
        except Exception as e:
            if _dcp_out_of_space(e):
                raise dist_write.no_space(ckpt_dir, iteration) from e
            raise
        faults.at("checkpoint:mid_write", iteration=iteration)
        for name in written:  # hashed from what is on disk, by the rank that wrote it
            ckpt_verify.write_digest(tmp, name)

    w.start(iteration, lambda: write_then_commit(
        write, lambda: dist_write.commit(ckpt_dir, tmp, iteration, layout, keep), iteration, w.group,
        discard=lambda: shutil.rmtree(tmp, ignore_errors=True)), on_done, copy)
    return True
