"""Writing Megatron-core's ``torch_dist`` checkpoint format without Megatron, through the save protocol.

A torch_dist checkpoint (the layout is :mod:`trainer.checkpoint.files`'s; what Megatron puts in it is
``trainer.convert.dist``'s docstring) is a ``torch.distributed.checkpoint`` folder: every tensor under
its *global* shape, each rank writing the chunks it owns at their global offsets, plus Megatron's
``common.pt`` and ``metadata.json``. Megatron's ``dist_checkpointing.load`` reads it back into any
(tp, pp) layout, as torch.distributed.checkpoint reassembles chunks by their offsets.

Each rank describes what it owns as :class:`Piece` s (a tensor chunk with its offsets in the global
tensor, or a pickled object under Megatron's ``ShardedObject`` key); a custom save planner hands exactly
those to torch's ``FileSystemWriter``. torch's global-plan validation then checks, on the coordinator,
that the chunks of every tensor stay in bounds and do not overlap, so an offset mistake fails the save
instead of writing a checkpoint that loads wrong.

The protocol (:mod:`trainer.checkpoint.protocol`'s numbered steps, with one shared folder instead of one
per shard, because torch_dist's data files and ``.metadata`` belong to one folder):

1. global rank 0 creates ``.tmp-iter_N`` beside the final folder; every rank writes its data files into
   it (fsynced by the writer), then its digests; rank 0 adds ``common.pt`` and ``metadata.json``;
2. all ranks meet at a barrier: every file is complete;
3. rank 0 writes the manifest, fsyncs the folder, renames it to ``iter_N`` (replacing only an
   uncommitted leftover), fsyncs the parent, commits the tracker and prunes.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainer import faults
from trainer.checkpoint import protocol as ckpt
from trainer.checkpoint import verify as ckpt_verify
from trainer.checkpoint.files import DIST_COMMON, DIST_CONFIG, DIST_INFO, DIST_METADATA, iter_dir_name
from trainer.disk import out_of_space
from trainer.log import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class Piece:
    """One entry this rank writes: a tensor chunk at ``offsets`` of a ``global_shape`` tensor named
    ``key``, or (``offsets`` None) an object saved under ``key`` as Megatron saves a ShardedObject."""

    key: str
    data: Any
    offsets: tuple[int, ...] | None = None
    global_shape: tuple[int, ...] | None = None


def _planner(pieces: list[Piece], like: list[Piece] | None = None):
    """A save planner that writes ``pieces``; ``like``: the pieces whose tensors' properties the metadata
    records (an asynchronous save writes host copies of them, pinned on a GPU: the metadata stays the one
    a synchronous save writes)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    def item(p: Piece, source: Piece) -> WriteItem:
        if p.offsets is None:
            return WriteItem(index=MetadataIndex(p.key), type=WriteItemType.BYTE_IO)
        chunk = ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=p.data.size())
        props = TensorProperties.create_from_tensor(source.data)
        return WriteItem(index=MetadataIndex(p.key, torch.Size(p.offsets)), type=WriteItemType.SHARD,
                         tensor_data=TensorWriteData(chunk=chunk, properties=props,
                                                     size=torch.Size(p.global_shape)))

    by_index = {(p.key, p.offsets): p.data for p in pieces}
    sources = like if like is not None else pieces

    class PiecePlanner(DefaultSavePlanner):
        """The default planner (global plan, metadata, validation) over this rank's pieces instead of a
        state dict's values."""

        def create_local_plan(self) -> SavePlan:
            self.plan = SavePlan([item(p, q) for p, q in zip(pieces, sources, strict=True)])
            return self.plan

        def lookup_object(self, index: MetadataIndex) -> Any:
            return by_index[(index.fqn, None if index.offset is None else tuple(index.offset))]

    return PiecePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def _writer(folder: str):
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemWriter(folder, sync_files=True, thread_count=1, overwrite=True)


def own_files(folder: str) -> list[str]:
    """The data files this rank wrote into ``folder`` (a rank with nothing to write, dp > 0, still gets an
    empty one, which .metadata names nowhere: removed)."""
    prefix, written = f"__{ckpt.global_rank()}_", []
    for name in sorted(n for n in os.listdir(folder) if n.startswith(prefix) and n.endswith(".distcp")):
        if os.path.getsize(os.path.join(folder, name)) == 0:
            os.remove(os.path.join(folder, name))
        else:
            written.append(name)
    return written


def write_pieces(folder: str, pieces: list[Piece]) -> list[str]:
    """Collective over the default process group: every rank's pieces into ``folder`` (data files and,
    from rank 0, ``.metadata``). Returns the data files this rank wrote."""
    import torch.distributed.checkpoint as dcp

    dcp.save({}, storage_writer=_writer(folder), planner=_planner(pieces), no_dist=not _distributed())
    return own_files(folder)


def start_pieces(folder: str, pieces: list[Piece], like: list[Piece], group: Any):
    """``write_pieces`` in the background: ``torch.distributed.checkpoint.async_save`` of ``pieces`` (host
    copies of ``like``) with its collectives on ``group`` (the checkpoint group, or None: the default
    one). Returns its future (the data files and ``.metadata`` are written, fsynced, when it is done)."""
    import torch.distributed.checkpoint as dcp

    return dcp.async_save({}, storage_writer=_writer(folder), planner=_planner(pieces, like),
                          process_group=group, no_dist=not _distributed())


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def write_common(folder: str, common: dict) -> None:
    """Rank 0's ``common.pt`` and ``metadata.json`` (fsynced)."""
    with open(os.path.join(folder, DIST_COMMON), "wb") as f:
        torch.save(common, f)
        f.flush()
        os.fsync(f.fileno())
    with open(os.path.join(folder, DIST_INFO), "w", encoding="utf-8") as f:
        json.dump(DIST_CONFIG, f)
        f.flush()
        os.fsync(f.fileno())


def no_space(ckpt_dir: str, iteration: int) -> ckpt.CheckpointSpaceError:
    return ckpt.CheckpointSpaceError(
        f"no space left on the device of {ckpt_dir} while writing the torch_dist checkpoint of iteration "
        f"{iteration}. Nothing was committed: the latest checkpoint is unchanged. Free space, lower "
        "checkpoint.keep, or set checkpoint.dir elsewhere")


def shared_tmp(ckpt_dir: str, iteration: int) -> str:
    """Step 1's folder: one name every rank derives alike (rank 0 empties a leftover of a killed save)."""
    tmp = os.path.join(ckpt_dir, f"{ckpt._TMP_PREFIX}{iter_dir_name(iteration)}")
    if ckpt.global_rank() == 0:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    ckpt._barrier()
    return tmp


def commit(ckpt_dir: str, tmp: str, iteration: int, layout: ckpt.ShardLayout, keep: int | None) -> None:
    """Step 3, on global rank 0."""
    final = os.path.join(ckpt_dir, iter_dir_name(iteration))
    for name in (DIST_METADATA, DIST_COMMON, DIST_INFO):
        ckpt_verify.write_digest(tmp, name)
    ckpt_verify.write_manifest(tmp, iteration, layout.tp_size, layout.pp_size, None)
    ckpt.fsync_dir(tmp)
    faults.at("checkpoint:before_rename", iteration=iteration)
    if os.path.exists(final):  # an uncommitted leftover of this iteration (see save_dist_checkpoint)
        ckpt._remove_aside(final)
    os.rename(tmp, final)
    ckpt.fsync_dir(ckpt_dir)
    faults.at("checkpoint:after_rename", iteration=iteration)
    faults.at("checkpoint:before_manifest_commit", iteration=iteration)
    ckpt._write_tracker(ckpt_dir, iteration)
    ckpt.prune(ckpt_dir, iteration, keep)


def save_dist_checkpoint(ckpt_dir: str, iteration: int, pieces: list[Piece], common: dict,
                         layout: ckpt.ShardLayout, keep: int | None) -> bool:
    """Collective over all ranks: the torch_dist counterpart of :func:`protocol.save_checkpoint` (same
    return value, same space check and errors). ``common``: rank 0's ``common.pt`` (others may pass {})."""
    if ckpt.already_committed(ckpt_dir, iteration):
        ckpt._barrier()
        return False
    mine = {"pieces": [p.data for p in pieces], "common": common if ckpt.global_rank() == 0 else {}}
    ckpt.check_space(ckpt_dir, iteration, mine, layout)
    tmp = shared_tmp(ckpt_dir, iteration)
    faults.at("checkpoint:before_write", iteration=iteration)
    try:
        written = write_pieces(tmp, pieces)
        if ckpt.global_rank() == 0:
            write_common(tmp, common)
    except (OSError, RuntimeError) as e:  # torch wraps an OSError in a RuntimeError
        if not out_of_space(e):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise no_space(ckpt_dir, iteration) from e
    faults.at("checkpoint:mid_write", iteration=iteration)
    for name in written:  # hashed from what is on disk, by the rank that wrote it
        ckpt_verify.write_digest(tmp, name)
    ckpt._barrier()  # step 2: every rank's files are complete on disk
    if ckpt.global_rank() == 0:
        commit(ckpt_dir, tmp, iteration, layout, keep)
    ckpt._barrier()
    log.info("saved torch_dist checkpoint at iteration %d to %s", iteration, ckpt_dir)
    return True
