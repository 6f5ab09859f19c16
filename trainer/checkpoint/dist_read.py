"""Reading a Megatron-core ``torch_dist`` folder's pieces with ``torch.distributed.checkpoint`` alone (no
process group, no Megatron import, no code from the files): its ``.metadata``, one object by key, and
the common (non-tensor) state — ``args``, ``iteration``, ``checkpoint_version`` — wherever the version
put it:

- ``common.pt`` beside the data files: megatron-core 0.7-0.18, and Slipway's own torch_dist saves;
- from core 0.19, no ``common.pt``: the common state is the ShardedObject ``common_state`` (key
  :data:`COMMON_STATE`) inside the ``.distcp`` files, a pickled one-element list
  (``dist_checkpointing.serialization.load_common_state_dict``).

The tensors themselves are read by ``trainer.convert.dist``.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.checkpoint.files import DIST_COMMON, DIST_METADATA, CheckpointError

# Megatron-core's ShardedObject("common_state", None, (1,), (0,)).unique_key (core 0.19 on).
COMMON_STATE = "common_state/shard_0_1"


class _MegatronStandIn:
    """Whatever Megatron class a ``.metadata`` pickle names: unpickled as attributes only."""


# What torch's FileSystemWriter pickles into ``.metadata`` (the Metadata dataclasses, tensor properties,
# torch sizes and dtypes, the storage paths), and nothing else may load from it: torch's own reader
# unpickles it with a plain pickle.load.
_METADATA_MODULES = ("torch.distributed.checkpoint.", "torch.distributed._shard.")
_METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                     ("pathlib", "PurePosixPath"), ("collections", "OrderedDict"), ("builtins", "set"),
                     ("builtins", "frozenset"), ("builtins", "slice"), ("torch._utils", "_rebuild_tensor_v2")}


class _MetadataUnpickler(pickle.Unpickler):
    """torch's ``.metadata`` unpickling restricted to what torch writes there, and Megatron's classes as
    stand-ins: since core_v0.13 the metadata keeps each rank's save plan as
    ``megatron.core.dist_checkpointing.strategies.torch.MCoreSavePlan`` (``Metadata.all_local_plans``),
    which nothing here reads and which must not need Megatron to load."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "megatron" or module.startswith("megatron."):
            return type(name, (_MegatronStandIn,), {"__module__": module})
        import torch

        found = super().find_class(module, name) if (
            module.startswith(_METADATA_MODULES) or (module, name) in _METADATA_GLOBALS
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.layout
                                                 | torch.memory_format))) else None
        if found is None:
            raise pickle.UnpicklingError(f"{DIST_METADATA} names {module}.{name}, which torch's "
                                         "checkpoint metadata never holds: refused (it could run code)")
        return found


def reader(iter_dir: str | Path):
    """torch's FileSystemReader over ``iter_dir`` with the restricted ``.metadata`` unpickler."""
    import torch.distributed.checkpoint as dcp

    iter_dir = Path(iter_dir)

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            from torch.distributed.checkpoint.metadata import StorageMeta

            with open(iter_dir / DIST_METADATA, "rb") as f:
                pickled = _MetadataUnpickler(f).load()
            # The rest is what FileSystemReader.read_metadata does after its plain pickle.load.
            if getattr(pickled, "storage_meta", None) is None:
                pickled.storage_meta = StorageMeta()
            pickled.storage_meta.load_id = self.load_id
            return pickled

    return Reader(str(iter_dir))


def read_metadata(iter_dir: str | Path):
    try:
        return reader(iter_dir).read_metadata()
    except Exception as e:  # noqa: BLE001 - reported with the folder and what to check
        raise CheckpointError(f"{Path(iter_dir) / DIST_METADATA} cannot be read ({type(e).__name__}: {e}): "
                              "the checkpoint is incomplete or not a torch.distributed.checkpoint") from e


def object_bytes(iter_dir: str | Path, key: str) -> bytes:
    """The pickled bytes of one object (a Megatron ShardedObject) of the checkpoint, unread."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    raw: dict[str, bytes] = {}

    class KeepBytes(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:  # torch's own unpickles anything
            raw[read_item.dest_index.fqn] = value.getvalue()

    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.load({key: io.BytesIO()}, storage_reader=reader(iter_dir), planner=KeepBytes(), no_dist=True)
        return raw[key]
    except Exception as e:  # noqa: BLE001 - reported with the folder and the key
        raise CheckpointError(f"{iter_dir}: the object {key!r} cannot be read ({type(e).__name__}: {e}); "
                              "the checkpoint is incomplete or was saved with another layout") from e


def has_common(iter_dir: str | Path) -> bool:
    """Whether the folder keeps its common state anywhere (``common.pt``, or ``common_state`` in the
    metadata); reads the metadata only without ``common.pt``."""
    if os.path.isfile(os.path.join(iter_dir, DIST_COMMON)):
        return True
    try:
        return COMMON_STATE in read_metadata(iter_dir).state_dict_metadata
    except CheckpointError:
        return False


def read_common(iter_dir: str | Path, load: Callable[[Any, str], Any]) -> dict:
    """The common state wherever the version put it (module docstring). ``load(source, where)`` unpickles
    a path or a BytesIO and reports errors for ``where`` (the caller's reader and its messages)."""
    path = Path(iter_dir) / DIST_COMMON
    if path.is_file():
        return load(path, str(path))
    if not has_common(iter_dir):
        raise CheckpointError(f"{iter_dir} has neither {DIST_COMMON} nor a {COMMON_STATE!r} object in its "
                              f"{DIST_METADATA}: the torch_dist checkpoint is incomplete (no args)")
    where = f"{iter_dir} ({COMMON_STATE!r} in its .distcp files)"
    state = load(io.BytesIO(object_bytes(iter_dir, COMMON_STATE)), where)
    if not (isinstance(state, list) and len(state) == 1 and isinstance(state[0], dict)):
        raise CheckpointError(f"{where} is not a one-element list holding a dict (found "
                              f"{type(state).__name__}): not a Megatron-core common state")
    return state[0]
