"""Reshard on load: read a checkpoint saved with one (tp, pp) layout into another.

For each tensor this rank needs, the source shards are merged into the full tensor (Megatron's TP rules,
``formats.md`` §4: column-parallel QKV, h→4h and word embeddings on dim 0; row-parallel dense and 4h→h
weights on dim 1; everything else replicated) with layer indices made global, the vocabulary padding is
adapted to the target's padded size (rows trimmed or zero-filled), and the target shard is sliced out.
Adam's moment tensors are resharded by the same rules (they are stored with their parameters' names), so
a resharded run continues with its optimizer state. RNG states are layout-specific and are not carried
over. Only the source stages that hold this rank's layers are read, memory-mapped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from trainer.checkpoint import SHARD_FILE, CheckpointError, iter_dir_name, shard_dir_name
from trainer.model.names import flatten

_COLUMN = ("self_attention.query_key_value.weight", "self_attention.query_key_value.bias",
           "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias", "word_embeddings.weight")
_ROW = ("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")
_LAYER_PREFIX = "encoder.layers."
WORD = "embedding.word_embeddings.weight"
HEAD = "word_embeddings_for_head.weight"


def tp_dim(name: str) -> int | None:
    """The dim a parameter is split on under TP (None: replicated)."""
    if name.endswith(_COLUMN):
        return 0
    if name.endswith(_ROW):
        return 1
    return None


def layer_of(name: str) -> tuple[int, str] | None:
    """(index, rest) for ``encoder.layers.{i}.rest``."""
    if not name.startswith(_LAYER_PREFIX):
        return None
    index, rest = name[len(_LAYER_PREFIX):].split(".", 1)
    return int(index), rest


@dataclass(frozen=True)
class Target:
    """The rank being loaded: its shard coordinates and what its model stage holds."""

    tp_rank: int
    tp_size: int
    layer_start: int
    layer_end: int
    pre_process: bool
    post_process: bool
    padded_vocab_size: int


class SourceCheckpoint:
    """The shards of one saved iteration, loaded lazily per pipeline stage (memory-mapped)."""

    def __init__(self, ckpt_dir: str, iteration: int, tp_size: int, pp_size: int, num_layers: int) -> None:
        if num_layers % pp_size:
            raise CheckpointError(f"saved num_layers={num_layers} is not divisible by its pp={pp_size}")
        self.base = os.path.join(ckpt_dir, iter_dir_name(iteration))
        self.tp_size, self.pp_size, self.per_stage = tp_size, pp_size, num_layers // pp_size
        self._stages: dict[int, list[dict]] = {}

    def stage(self, pp_rank: int) -> list[dict]:
        """The tp shards of one stage: ``{"model": flat, "moments": {name: {key: tensor}}, "raw": shard}``."""
        if pp_rank not in self._stages:
            shards = []
            for t in range(self.tp_size):
                path = os.path.join(self.base, shard_dir_name(t, pp_rank, self.pp_size), SHARD_FILE)
                if not os.path.isfile(path):
                    raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
                raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                shards.append({"model": flatten(raw["model"]), "moments": _moments_by_name(raw),
                               "raw": raw})
            self._stages[pp_rank] = shards
        return self._stages[pp_rank]

    def locate(self, global_name: str) -> tuple[int, str]:
        """(source pp rank, local name) of a parameter given its global name."""
        found = layer_of(global_name)
        if found is not None:
            index, rest = found
            return index // self.per_stage, f"{_LAYER_PREFIX}{index % self.per_stage}.{rest}"
        if global_name.startswith("embedding."):
            return 0, global_name
        if global_name == HEAD:  # the head copy equals the word embeddings: read those
            return 0, WORD
        return self.pp_size - 1, global_name  # final_layernorm

    def full(self, global_name: str, key: str | None = None) -> torch.Tensor:
        """The merged full tensor of a parameter (``key`` None) or of one of its optimizer moments."""
        pp_rank, local = self.locate(global_name)
        parts = []
        for shard in self.stage(pp_rank):
            table = shard["model"] if key is None else shard["moments"].get(local, {})
            wanted = local if key is None else key
            if wanted not in table:
                raise CheckpointError(f"{global_name} ({key or 'weights'}) is not in the saved stage "
                                      f"{pp_rank}: the checkpoint does not match this model")
            parts.append(table[wanted])
        dim = tp_dim(local)
        if dim is None or self.tp_size == 1 or not torch.is_tensor(parts[0]) or parts[0].dim() == 0:
            return parts[0]
        return torch.cat(parts, dim=dim)


def _moments_by_name(raw: dict) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer state of one shard keyed by parameter name (needs ``param_names``)."""
    opt = raw.get("optimizer") or {}
    names = opt.get("param_names")
    if not names:
        return {}
    state = opt["optimizer"]["state"]
    return {name: dict(state.get(i, {})) for i, name in enumerate(names)}


def _fit_vocab(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Trim or zero-pad the padded vocabulary rows (padding rows are zero and never trained)."""
    if t.shape[0] == rows:
        return t
    if t.shape[0] > rows:
        return t[:rows]
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def target_slice(full: torch.Tensor, local_name: str, target: Target) -> torch.Tensor:
    """This rank's shard of a full tensor."""
    if local_name.endswith("word_embeddings.weight"):
        full = _fit_vocab(full, target.padded_vocab_size)
    dim = tp_dim(local_name)
    if dim is None or target.tp_size == 1 or full.dim() == 0:
        return full.clone()
    return torch.chunk(full, target.tp_size, dim=dim)[target.tp_rank].clone()


def global_name(local_name: str, layer_start: int) -> str:
    found = layer_of(local_name)
    if found is None:
        return local_name
    return f"{_LAYER_PREFIX}{found[0] + layer_start}.{found[1]}"


def reshard_model(src: SourceCheckpoint, local_names: list[str], target: Target) -> dict[str, torch.Tensor]:
    """Flat local-name → tensor dict for the target rank's parameters."""
    return {n: target_slice(src.full(global_name(n, target.layer_start)), n, target) for n in local_names}


def reshard_moments(src: SourceCheckpoint, local_names: list[str], target: Target
                    ) -> dict[str, dict[str, torch.Tensor]]:
    """Per target parameter, its optimizer state entries resharded (scalars such as ``step`` copied)."""
    out = {}
    for n in local_names:
        g = global_name(n, target.layer_start)
        pp_rank, local = src.locate(g)
        keys = src.stage(pp_rank)[0]["moments"].get(local, {})
        out[n] = {k: (v if not torch.is_tensor(v) else v.clone() if v.dim() == 0
                      else target_slice(src.full(g, k), n, target)) for k, v in keys.items()}
    return out
