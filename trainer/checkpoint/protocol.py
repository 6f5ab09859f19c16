"""Megatron legacy checkpoints (``formats.md`` §4), written atomically, loaded exactly.

The folder layout and the tracker are :mod:`trainer.checkpoint.files`'s. Each shard holds Megatron's
top-level keys ``args`` (an ``argparse.Namespace`` of plain values: :mod:`trainer.checkpoint.megatron_args`),
``checkpoint_version`` (3.0), ``iteration``, ``model`` (legacy nested GPT names), ``optimizer``
(``{"optimizer": torch state, "grad_scaler": ..., "param_names": [...]}``), ``opt_param_scheduler``,
``rng_state`` (a list indexed by data-parallel rank, as Megatron), plus ``slipway`` (the full run config
and counters). Everything loads with ``torch.load(weights_only=True)`` once ``argparse.Namespace`` is
allowed (``torch.serialization.safe_globals``); :func:`load_file` does that.

Atomicity (the protocol, in order):
1. every writing rank (data-parallel rank 0 of each (tp, pp)) writes its file into a private temporary
   directory next to its final one, flushes and fsyncs it and the directory, then renames the directory
   into place (replacing only an *uncommitted* leftover of the same iteration) and fsyncs the parent;
2. all ranks meet at a barrier: every shard is complete;
3. global rank 0 writes the tracker to a temporary file, fsyncs it and ``os.replace``-s the tracker —
   the commit point — then prunes old checkpoints (renamed aside before deletion).
A kill at any moment leaves the tracker pointing at a complete checkpoint; stray temporary or uncommitted
directories are ignored by loaders and cleaned by later saves.

Disk space: before writing, the ranks add up the bytes of every shard and compare them with the free space
of the checkpoint filesystem (rank 0's view, so all ranks decide alike); a shortfall raises
:class:`CheckpointSpaceError` on every rank before anything is written. A write that still runs out of
space (another writer filled the disk) removes its temporary directory and raises the same error. Either
way the tracker keeps pointing at the previous complete checkpoint.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from trainer import faults
from trainer.checkpoint import dist_read, pickles
from trainer.checkpoint import verify as ckpt_verify
from trainer.checkpoint.files import (  # noqa: F401 (the layout's names, re-exported for the trainer)
    CHECKPOINT_VERSION,
    DIST_COMMON,
    DIST_METADATA,
    SHARD_FILE,
    TRACKER,
    CheckpointError,
    CheckpointSpaceError,
    arg,
    fsync_dir,
    iter_dir_name,
    iter_path,
    list_iterations,
    read_tracker,
    shard_dir_name,
    shard_path,
    write_tracker,
)
from trainer.checkpoint.space import mib as _mib
from trainer.checkpoint.space import state_bytes, sum_over_ranks
from trainer.disk import out_of_space
from trainer.log import get_logger

log = get_logger(__name__)

_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"


@dataclass(frozen=True)
class ShardLayout:
    """This rank's place in the checkpoint: which shard it owns and whether it writes it."""

    tp_rank: int = 0
    pp_rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1

    @property
    def writes(self) -> bool:
        """Data-parallel replicas hold identical shards: only dp rank 0 writes (as Megatron)."""
        return self.dp_rank == 0


_iter_dir = iter_path


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _remove_aside(path: str) -> None:
    """Rename ``path`` to a hidden trash name first, so a kill mid-delete never leaves a half-deleted
    directory under a name that looks like a checkpoint, then delete it."""
    parent, base = os.path.split(path)
    trash = os.path.join(parent, f"{_TRASH_PREFIX}{base}-{os.getpid()}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _discard(tmp: str, parent: str) -> None:
    """Remove a failed write's temporary folder (gives the space back) and its iteration folder when no
    other rank's shard is in it yet."""
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.rmdir(parent)
    except OSError:
        pass


def _enospc_message(final_dir: str, iteration: int, state: dict) -> str:
    parent = os.path.dirname(final_dir)
    free = shutil.disk_usage(os.path.dirname(parent)).free
    return (f"no space left on the device of {parent} while writing {os.path.basename(final_dir)} of "
            f"iteration {iteration}: this shard needs ~{_mib(state_bytes(state))} MiB ({_mib(free)} MiB free "
            "now). Nothing was committed: the latest checkpoint is unchanged. Free space, lower "
            "checkpoint.keep, or set checkpoint.dir elsewhere")


def _write_shard(state: dict, final_dir: str, iteration: int, extra_files: dict[str, dict] | None = None
                 ) -> None:
    """Step 1 of the protocol for this rank's shard (and the files written beside it, e.g. the
    distributed optimizer's ``distrib_optim.pt``: same folder, same fsync and rename)."""
    parent = os.path.dirname(final_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f"{_TMP_PREFIX}{os.path.basename(final_dir)}-{os.getpid()}")
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    faults.at("checkpoint:before_write", iteration=iteration)
    files = {SHARD_FILE: state, **(extra_files or {})}
    digests = {}
    try:
        for name, content in files.items():
            with open(os.path.join(tmp, name), "wb") as f:
                out = ckpt_verify.HashingWriter(f)
                torch.save(content, out)
                faults.at("checkpoint:mid_write", iteration=iteration)
                f.flush()
                os.fsync(f.fileno())
            digests[name] = out.digest()
    except (OSError, RuntimeError) as e:  # torch.save wraps the OSError in a RuntimeError
        if not out_of_space(e):
            raise
        _discard(tmp, parent)
        raise CheckpointSpaceError(_enospc_message(final_dir, iteration, files)) from e
    for name in files:  # for the manifest: the bytes written, hashed as they were written
        ckpt_verify.write_digest(tmp, name, digests[name])
    fsync_dir(tmp)
    faults.at("checkpoint:before_rename", iteration=iteration)
    if os.path.exists(final_dir):  # an uncommitted leftover of this iteration (see save_checkpoint)
        _remove_aside(final_dir)
    os.rename(tmp, final_dir)
    fsync_dir(parent)
    faults.at("checkpoint:after_rename", iteration=iteration)


def _write_tracker(ckpt_dir: str, iteration: int) -> None:
    """Step 3: the commit point (layout.write_tracker, the one writer of the tracker)."""
    write_tracker(ckpt_dir, iteration,
                  before_commit=lambda: faults.at("checkpoint:before_tracker", iteration=iteration))
    faults.at("checkpoint:after_tracker", iteration=iteration)


def _clean_temporaries(folder: str) -> None:
    """Remove leftovers of killed saves: temporary shard folders, trash, temporary tracker files."""
    for name in os.listdir(folder):
        if name.startswith((_TMP_PREFIX, _TRASH_PREFIX)) or name.startswith(f"{TRACKER}.tmp-"):
            path = os.path.join(folder, name)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)


def prune(ckpt_dir: str, committed: int, keep: int | None) -> None:
    """Keep the newest ``keep`` checkpoints up to ``committed`` (always including it); remove older ones,
    stale temporary/trash entries. Folders newer than ``committed`` are left alone: they may be a later
    run's checkpoints that the user rewound from (``checkpoint.load: N``)."""
    _clean_temporaries(ckpt_dir)
    for iteration in list_iterations(ckpt_dir):
        _clean_temporaries(os.path.join(ckpt_dir, iter_dir_name(iteration)))
    if not keep:
        return
    # Only checkpoints that verify (sizes: cheap) count towards `keep`, so a damaged one never costs the
    # last good one its place; a damaged one is moved aside, not deleted.
    kept = 0
    for iteration in reversed([i for i in list_iterations(ckpt_dir) if i <= committed]):
        path = os.path.join(ckpt_dir, iter_dir_name(iteration))
        wrong = ckpt_verify.problems(path, SHARD_FILE, full=False) if iteration != committed else []
        if wrong:
            log.warning("checkpoint iteration %d failed verification (%s); moved aside to %s", iteration,
                        "; ".join(wrong), ckpt_verify.quarantine(path))
        elif kept < keep:
            kept += 1
        else:
            _remove_aside(path)
            log.info("removed checkpoint iteration %d (checkpoint.keep=%d)", iteration, keep)


def check_space(ckpt_dir: str, iteration: int, state: dict, layout: ShardLayout) -> None:
    """Collective: raise :class:`CheckpointSpaceError` on every rank when the shards of ``iteration``
    (all ranks together) would not fit in the free space of ``ckpt_dir``'s filesystem."""
    os.makedirs(ckpt_dir, exist_ok=True)
    mine = state_bytes(state) if layout.writes else 0
    # Rank 0's view of the free space, so every rank takes the same decision.
    free = shutil.disk_usage(ckpt_dir).free if global_rank() == 0 else 0
    need, free = sum_over_ranks([mine, free])
    if need > free:
        latest = read_tracker(ckpt_dir)
        kept = "there is no earlier checkpoint" if latest is None else \
            f"the latest checkpoint (iteration {latest}) is unchanged"
        raise CheckpointSpaceError(
            f"not enough space in {ckpt_dir} for the checkpoint of iteration {iteration}: it needs "
            f"~{_mib(need)} MiB, {_mib(free)} MiB are free. Nothing was written: {kept}. Free space, lower "
            "checkpoint.keep, or set checkpoint.dir to a larger filesystem")


def already_committed(ckpt_dir: str, iteration: int) -> bool:
    """The iteration is the committed one (then nothing is rewritten: the state at an iteration is unique)."""
    if read_tracker(ckpt_dir) == iteration and os.path.isdir(_iter_dir(ckpt_dir, iteration)):
        log.info("checkpoint at iteration %d already committed in %s", iteration, ckpt_dir)
        return True
    return False


def write_files(ckpt_dir: str, iteration: int, files: dict[str, Any], layout: ShardLayout) -> None:
    """Step 1 on a writing rank: ``files`` (name → content: the shard first) into its shard folder."""
    if layout.writes:
        final = os.path.join(ckpt_dir, iter_dir_name(iteration),
                             shard_dir_name(layout.tp_rank, layout.pp_rank, layout.pp_size))
        files = dict(files)
        _write_shard(files.pop(SHARD_FILE), final, iteration, files)


def commit(ckpt_dir: str, iteration: int, layout: ShardLayout, keep: int | None) -> None:
    """Step 3 on global rank 0, once every shard is complete: manifest, tracker, prune."""
    missing = [p for t in range(layout.tp_size) for p in range(layout.pp_size)
               if not os.path.isfile(shard_path(ckpt_dir, iteration, t, p, layout.pp_size))]
    if missing:
        raise CheckpointError(f"shards {missing} of iteration {iteration} are missing after the barrier; "
                              f"is {ckpt_dir} on a filesystem shared by all nodes?")
    ckpt_verify.write_manifest(_iter_dir(ckpt_dir, iteration), iteration, layout.tp_size,
                               layout.pp_size, SHARD_FILE)
    faults.at("checkpoint:before_manifest_commit", iteration=iteration)
    _write_tracker(ckpt_dir, iteration)
    prune(ckpt_dir, iteration, keep)


def save_checkpoint(ckpt_dir: str, iteration: int, state: dict, layout: ShardLayout,
                    keep: int | None, extra_files: dict[str, dict] | None = None) -> bool:
    """Collective over all ranks: check the space, write this rank's shard, commit, prune. Returns False
    when the iteration was already committed (then nothing is rewritten: the state at an iteration is
    unique). ``extra_files``: name → content written beside this rank's shard (``distrib_optim.pt``).
    The asynchronous counterpart runs the same steps in the background (trainer.checkpoint.background)."""
    if already_committed(ckpt_dir, iteration):
        _barrier()
        return False
    files = {SHARD_FILE: state, **(extra_files or {})}
    check_space(ckpt_dir, iteration, files, layout)
    write_files(ckpt_dir, iteration, files, layout)
    _barrier()  # step 2: every shard of this iteration is complete on disk
    if global_rank() == 0:
        commit(ckpt_dir, iteration, layout, keep)
    _barrier()
    log.info("saved checkpoint at iteration %d to %s", iteration, ckpt_dir)
    return True


def select_latest(ckpt_dir: str, *, act: bool = True, full: bool = True) -> ckpt_verify.Choice:
    """Collective: the newest checkpoint of ``ckpt_dir`` that verifies (:func:`ckpt_verify.choose_latest`;
    ``full=False``: by sizes, the checksums being the caller's: trainer.checkpoint.deferred). Global rank 0
    decides — with ``act``, it moves damaged checkpoints aside and points the tracker at its choice — and
    every rank gets the same answer. Raises :class:`CheckpointError` when checkpoints exist but none
    verifies (starting over would overwrite them)."""
    out: list[Any] = [None]
    if global_rank() == 0:
        try:
            choice = ckpt_verify.choose_latest(ckpt_dir, act=act, full=full)
            if act and choice.iteration is not None and choice.iteration != choice.tracker_iteration:
                _write_tracker(ckpt_dir, choice.iteration)
            out = [choice]
        except ckpt_verify.NoVerifiedCheckpoint as e:
            out = [str(e)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        nccl = dist.get_backend() == "nccl"
        dist.broadcast_object_list(out, src=0, device=torch.device("cuda", torch.cuda.current_device())
                                   if nccl else None)
    if isinstance(out[0], str):
        raise CheckpointError(out[0])
    return out[0]


def load_file(path: str, *, mmap: bool = False) -> dict:
    """One shard, safely, onto the CPU: ``torch.load(weights_only=True)`` plus ``argparse.Namespace``
    (the ``args``), numpy RNG pieces, standard-library enums and inert stand-ins for Megatron's classes
    (:mod:`trainer.checkpoint.pickles`); no code from the file runs."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} does not exist: the checkpoint is incomplete or was saved with a "
                              "different layout")
    return _load(path, path, mmap)


def _load(source: Any, where: str, mmap: bool) -> Any:
    """:func:`load_file` of a path or a BytesIO (a torch_dist object), errors naming ``where``."""
    try:
        return pickles.load(source, mmap=mmap, where=where)
    except pickles.UnsafePickle as e:
        raise CheckpointError(f"{where} cannot be read safely: it pickles {', '.join(e.names)}, beyond "
                              f"{pickles.SAFE_KINDS}, and the trainer never runs code from a checkpoint. "
                              "Start from its weights through the converters, which can: python -m "
                              "trainer.convert.to_hf --trust-pickle (the modules it names importable), then "
                              "python -m trainer.convert.from_hf into a checkpoint for checkpoint.load_dir "
                              "(checkpoint.load=model-only)") from e
    except Exception as e:  # noqa: BLE001 - re-raised with the file and the fix
        raise CheckpointError(f"{where} cannot be read ({type(e).__name__}: {e}); it is corrupt or holds "
                              "pickled objects (a Megatron-LM checkpoint: convert it with "
                              "trainer.convert first)") from e


def saved_layout(ckpt_dir: str, iteration: int, *, mmap: bool = False) -> tuple[int, int, Any]:
    """(tp_size, pp_size, args) of a saved checkpoint, read from its first shard's ``args`` (a Namespace,
    or a dict in older Slipway checkpoints: read it with :func:`~trainer.checkpoint.files.arg`).
    ``mmap``: leave the tensors on disk (a launch reads only the args)."""
    base = _iter_dir(ckpt_dir, iteration)
    if not os.path.isdir(base):
        raise CheckpointError(f"{base} does not exist; available iterations in {ckpt_dir}: "
                              f"{list_iterations(ckpt_dir) or 'none'}")
    first = [n for n in sorted(os.listdir(base)) if n.startswith("mp_rank_00")]
    if os.path.isfile(os.path.join(base, DIST_METADATA)):  # torch_dist: the args are in its common state
        path = base
        args = dist_read.read_common(base, lambda src, where: _load(src, where, mmap)).get("args")
    elif not first:
        raise CheckpointError(f"{base} holds no mp_rank_* shard: incomplete checkpoint")
    else:
        path = os.path.join(base, first[0], SHARD_FILE)
        args = load_file(path, mmap=mmap).get("args")
    sizes = [arg(args, k) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size")]
    if None in sizes:
        raise CheckpointError(f"{path} has no args.tensor_model_parallel_size/pipeline_model_parallel_size: "
                              "its layout is unknown (not a Slipway checkpoint?); convert it with "
                              "trainer.convert or load another")
    return int(sizes[0]), int(sizes[1]), args


# ---------------------------------------------------------------------------------------- RNG states

def rng_state(tracker_states: dict | None) -> dict:
    """This process's RNG states (Megatron's keys), as weights-only-loadable values."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"random_rng_state": random.getstate(),
             "np_rng_state": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
             "torch_rng_state": torch.get_rng_state(),
             "rng_tracker_states": tracker_states or {}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> dict:
    """Restore everything but the tracker, whose states are returned for the model-parallel tracker."""
    random.setstate(state["random_rng_state"])
    kind, keys, pos, has_gauss, gauss = state["np_rng_state"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch_rng_state"])
    if "cuda_rng_state" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    return state.get("rng_tracker_states", {})


def gather_rng_states(tracker_states: dict | None, dp_group: Any, dp_size: int) -> list[dict]:
    """Megatron's ``rng_state``: the list of every data-parallel rank's states (collective on dp)."""
    mine = rng_state(tracker_states)
    if dp_size == 1:
        return [mine]
    out: list[Any] = [None] * dp_size
    dist.all_gather_object(out, mine, group=dp_group)
    return out
