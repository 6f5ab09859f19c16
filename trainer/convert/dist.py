"""Reading Megatron-core's ``torch_dist`` checkpoints with ``torch.distributed.checkpoint`` alone.

The default format of current Megatron-LM (``--use-dist-ckpt``, ``--dist-ckpt-format torch_dist``)::

    iter_0000007/.metadata        torch.distributed.checkpoint metadata: every tensor's global shape
    iter_0000007/__R_I.distcp     the chunks, written by each rank
    iter_0000007/common.pt        args, iteration, checkpoint_version (a plain torch file; from core
                                  0.19 not written: a ``common_state`` object in the .distcp files)
    iter_0000007/metadata.json    {"sharded_backend": "torch_dist", ...}

Tensors are stored *global* (tp shards and pp stages already assembled by the format), with the layers
of ``decoder.layers`` stacked along a leading dimension and, for the local spec too, Transformer-Engine
names for the layer norms (``self_attention.linear_qkv.layer_norm_weight``). :func:`load_dist` reads the
tensors with no process group and no Megatron import, unstacks the layers, and returns Megatron-core
flat names (``decoder.layers.{i}.…``) for :func:`trainer.convert.mcore.normalise_names`.
"""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import dist_read
from trainer.checkpoint.files import DIST_COMMON, DIST_INFO, DIST_METADATA
from trainer.convert.shard_io import CheckpointError, load_shard

METADATA, COMMON = DIST_METADATA, DIST_COMMON
STACKED = "decoder.layers."


def is_dist(iter_dir: Path) -> bool:
    """A torch_dist folder: its ``.metadata`` is there (the common state is in ``common.pt`` beside it, or
    from core 0.19 inside the data files: :func:`trainer.checkpoint.dist_read.read_common`)."""
    return (iter_dir / METADATA).is_file()


def _backend(iter_dir: Path) -> None:
    info = iter_dir / DIST_INFO
    backend = json.loads(info.read_text()).get("sharded_backend") if info.is_file() else "torch_dist"
    if backend != "torch_dist":
        raise CheckpointError(f"{iter_dir} is a Megatron distributed checkpoint in the {backend!r} format; "
                              "Slipway reads torch_dist (re-save with --dist-ckpt-format torch_dist, or in "
                              "the torch format with --ckpt-format torch)")


OPTIMIZER = "optimizer."  # Megatron's optimizer state (``optimizer.state.exp_avg.<param key>``, …)


def read_tensors(iter_dir: Path, keep=lambda key: not key.startswith(OPTIMIZER)) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors that ``keep`` selects (by default the model's: not the optimizer state),
    at their global shape (objects such as RNG states are skipped)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dist_read.read_metadata(iter_dir)
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
             if isinstance(m, TensorStorageMetadata) and keep(k)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load(state, storage_reader=dist_read.reader(iter_dir), no_dist=True)
    return state


def read_object(iter_dir: Path, key: str) -> Any:
    """One object of the checkpoint (a Megatron ShardedObject: the list of its data) by its key,
    unpickled weights-only with :mod:`trainer.checkpoint.pickles`' allowances (no code runs)."""
    return load_shard(io.BytesIO(dist_read.object_bytes(iter_dir, key)), where=f"{iter_dir} ({key!r})")


def read_common(iter_dir: Path, trust_pickle: bool = False) -> dict[str, Any]:
    """``args``, ``iteration``, ``checkpoint_version`` …: ``common.pt``, or core 0.19's ``common_state``."""
    return dist_read.read_common(iter_dir, lambda src, where: load_shard(src, trust_pickle, where))


def unstack(state: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """``decoder.layers.X`` [L, ...] → ``decoder.layers.{i}.X`` [...] for i < L."""
    out = {}
    for name, tensor in state.items():
        if not name.startswith(STACKED) or name[len(STACKED):].split(".", 1)[0].isdigit():
            out[name] = tensor
            continue
        if tensor.shape[0] != num_layers:
            raise CheckpointError(f"{name} stacks {tensor.shape[0]} layers but args.num_layers is "
                                  f"{num_layers}: the checkpoint and its args do not belong together")
        rest = name[len(STACKED):]
        out.update({f"{STACKED}{i}.{rest}": tensor[i].clone() for i in range(num_layers)})
    return out


def load_dist(iter_dir: Path, trust_pickle: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(Megatron-core flat state with per-layer names, the common metadata: args, iteration, version)."""
    _backend(iter_dir)
    common = read_common(iter_dir, trust_pickle)
    args = common.get("args")
    num_layers = getattr(args, "num_layers", None) if args is not None else None
    if num_layers is None:
        raise CheckpointError(f"{iter_dir}'s common state has no args.num_layers: cannot unstack the layers")
    state = unstack(read_tensors(iter_dir), int(num_layers))
    return state, {k: common.get(k) for k in ("args", "checkpoint_version", "iteration")}
