"""Which checkpoint a run starts from, and its verification while it loads (start-up after a requeue).

:func:`resolve_load` picks the checkpoint (``checkpoint.load``; "latest" is the newest that verifies:
:func:`trainer.checkpoint.protocol.select_latest`). A restart used to hash every file of that checkpoint
(SHA-256 against its manifest) before loading it, then read the same bytes again to load them: two reads
in a row, the first of which only computed a checksum. Now the choice checks sizes, and
:class:`LoadCheck` hashes the chosen checkpoint on global rank 0 in a thread while every rank loads it
(hashlib drops the GIL; the load reads the same pages, so the disk serves them once): start-up pays
about the longer of the two, not their sum. When the checksums fail, the choice is made again with full
verification (which moves the damaged one aside, ``iter_N.damaged-<time>``, with a warning in the log,
status and summary, as ever) and the one before it is loaded over the first; nothing has trained yet.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from trainer.checkpoint import protocol as ckpt
from trainer.checkpoint import verify as ckpt_verify
from trainer.config import CheckpointConfig
from trainer.log import get_logger

log = get_logger(__name__)


def resolve_load(cfg: CheckpointConfig, run_dir: str | None = None, full: bool = True,
                 deferred: list | None = None) -> tuple[str, int, bool] | None:
    """(directory, iteration, model_only) to load at start, or None to start fresh. "Latest" means the
    newest checkpoint that verifies (:func:`checkpoint.select_latest`): a damaged one is moved aside and
    the one before it loaded, a missing tracker never means "start over" while checkpoints exist. What
    was skipped is logged and recorded in ``<run_dir>/checkpoint_warnings.jsonl`` (status, summary).
    ``full=False``: sizes only now; each choice made so is appended to ``deferred`` as (directory,
    iteration, act), for its checksums to be verified while it loads (trainer.checkpoint.deferred)."""
    if cfg.load == "none":
        own = ckpt.read_tracker(cfg.dir)
        if own is not None:
            log.warning("checkpoint.load=none: starting fresh although %s holds iteration %d", cfg.dir, own)
        return None
    load_dir = cfg.load_dir or cfg.dir
    foreign = os.path.abspath(load_dir) != os.path.abspath(cfg.dir)
    own = _latest(cfg.dir, run_dir, True, full, deferred)
    if own is not None and foreign:
        return cfg.dir, own, False  # a restarted run continues from its own checkpoints
    if cfg.load == "model-only":
        if not foreign:
            raise ValueError("checkpoint.load=model-only reads checkpoint.load_dir (another run's "
                             "checkpoints); set load_dir to a directory other than checkpoint.dir")
        it = _latest(load_dir, run_dir, False, full, deferred)  # another run's folder: verify, never move
        if it is None:
            raise ckpt.CheckpointError(f"checkpoint.load=model-only but {load_dir} holds no checkpoint "
                                       f"({ckpt.TRACKER} and iter_* folders are missing)")
        return load_dir, it, True
    if cfg.load == "latest":
        it = own if not foreign else _latest(load_dir, run_dir, False, full, deferred)
        return None if it is None else (load_dir, it, False)
    return load_dir, int(cfg.load), False


def _latest(ckpt_dir: str, run_dir: str | None, act: bool, full: bool = True,
            deferred: list | None = None) -> int | None:
    choice = ckpt.select_latest(ckpt_dir, act=act, full=full)
    for warning in choice.warnings:
        log.warning("%s", warning)
    if choice.warnings and run_dir and ckpt.global_rank() == 0:
        ckpt_verify.record_warnings(run_dir, choice.warnings)
    if not full and deferred is not None and choice.iteration is not None:
        deferred.append((ckpt_dir, choice.iteration, act))
    return choice.iteration


class LoadCheck:
    """The checksums of the checkpoint being loaded, hashed on global rank 0 in a thread (module doc)."""

    def __init__(self, ckpt_dir: str, iteration: int, act: bool) -> None:
        self.ckpt_dir, self.iteration, self.act = ckpt_dir, iteration, act
        self.problems: list[str] = []
        self._thread: threading.Thread | None = None
        if ckpt.global_rank() == 0:
            self._thread = threading.Thread(target=self._hash, name="slipway-verify", daemon=True)
            self._thread.start()

    @classmethod
    def start(cls, plan: tuple[str, int, bool] | None, chosen: list) -> LoadCheck | None:
        """The check of ``plan`` if :func:`resolve_load` chose it by sizes (``chosen``), else None (an
        explicit ``checkpoint.load: N`` is loaded as named)."""
        if plan is None:
            return None
        match = [c for c in chosen if c[0] == plan[0] and c[1] == plan[1]]
        return cls(*match[0]) if match else None

    def _hash(self) -> None:
        try:
            self.problems = ckpt_verify.problems(ckpt.iter_path(self.ckpt_dir, self.iteration),
                                                 ckpt.SHARD_FILE, full=True)
        except OSError as e:
            self.problems = [f"could not be read: {e}"]

    def confirm(self) -> bool:
        """Collective, after the load: whether the checksums held (every rank gets rank 0's verdict)."""
        if self._thread is not None:
            self._thread.join()
        out: list[Any] = [self.problems]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            nccl = dist.get_backend() == "nccl"
            dist.broadcast_object_list(out, src=0, device=torch.device("cuda", torch.cuda.current_device())
                                       if nccl else None)
        self.problems = out[0]
        if self.problems:
            log.warning("checkpoint iteration %d in %s failed its checksums while it loaded (%s): choosing "
                        "again with full verification", self.iteration, self.ckpt_dir,
                        "; ".join(self.problems))
        return not self.problems


Plan = tuple[str, int, bool]


def load_checked(plan: Plan | None, check: LoadCheck | None, load: Callable[[Plan], Any],
                 choose_again: Callable[[], Plan | None]) -> tuple[Plan | None, Any]:
    """(plan, what ``load`` returned) once ``check`` has confirmed the loaded checkpoint. A damaged one is
    replaced by ``choose_again()`` (the choice with full verification, which moves it aside, warns and
    records it as a choice at start always did, and takes the one before it; with none left it refuses to
    start), loaded over it. A load that fails on a damaged file (a corrupt pickle) is the same case, not
    an error."""
    if plan is None:
        return None, None
    try:
        loaded, error = load(plan), None
    except Exception as e:  # noqa: BLE001 - the checksums say whether this is damage (else re-raised)
        if check is None:
            raise
        loaded, error = None, e
    if check is None or check.confirm():
        if error is not None:
            raise error
        return plan, loaded
    plan = choose_again()
    if plan is None:  # cannot be: the damaged one is still there to be refused, or one before it chosen
        raise ckpt.CheckpointError(f"checkpoint iteration {check.iteration} in {check.ckpt_dir} failed its "
                                   "checksums after it was loaded and no checkpoint was chosen instead")
    return plan, load(plan)
