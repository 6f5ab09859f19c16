"""Reshard on load: read a checkpoint saved with one (tp, pp) layout into another.

For each tensor this rank needs, the source shards are merged into the full tensor (by the one sharding
table, ``trainer.parallel.sharding``) with layer indices made global, the vocabulary padding is
adapted to the target's padded size (rows trimmed or zero-filled), and the target shard is sliced out.
Interleaved checkpoints (v model chunks per stage, ``model0`` … entries: ``trainer.checkpoint.chunks``)
and Megatron's uneven splits (args.decoder_first/last_pipeline_num_layers) are read as well as written;
the target's chunks are loaded one :class:`Target` at a time.
Adam's moment tensors are resharded by the same rules (they are stored with their parameters' names), so
a resharded run continues with its optimizer state. RNG states are layout-specific and are not carried
over. Only the source stages that hold this rank's layers are read, memory-mapped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from trainer.checkpoint.chunks import chunk_entries
from trainer.checkpoint.files import SHARD_FILE, CheckpointError, iter_dir_name, shard_dir_name
from trainer.checkpoint.protocol import load_file
from trainer.convert.mcore import gpt_flat
from trainer.formulas import PipelineSplit
from trainer.model.names import layer_index, renumber
from trainer.parallel.sharding import DIM, VOCAB, kind, merge_tp, split_tp

WORD = "embedding.word_embeddings.weight"
HEAD = "word_embeddings_for_head.weight"


@dataclass(frozen=True)
class Target:
    """The rank (model chunk) being loaded: its shard coordinates and what its stage or chunk holds."""

    tp_rank: int
    tp_size: int
    layer_start: int
    layer_end: int
    pre_process: bool
    post_process: bool
    padded_vocab_size: int
    swiglu: bool = False  # the MLP's first matrix splits as the sharding table's GLU kind
    untied: bool = False  # an untied output layer (mcore's output_layer.weight is that, not a head copy)


class SourceCheckpoint:
    """The shards of one saved iteration, loaded lazily per pipeline stage (memory-mapped), split over its
    stages and model chunks as ``split`` says (its args: even, or Megatron's uneven split; v chunks per
    stage). Tensors and moments are keyed by global names."""

    def __init__(self, ckpt_dir: str, iteration: int, tp_size: int, split: PipelineSplit,
                 swiglu: bool = False, untied: bool = False) -> None:
        why = split.problem()
        if why:
            raise CheckpointError(f"saved checkpoint layout: {why}")
        self.base = os.path.join(ckpt_dir, iter_dir_name(iteration))
        self.tp_size, self.split, self.pp_size = tp_size, split, split.pp_size
        self.num_layers, self.virtual_pp_size = split.num_layers, split.virtual_pp_size
        self.swiglu, self.untied = swiglu, untied
        self._stages: dict[int, list[dict]] = {}

    def stage(self, pp_rank: int) -> list[dict]:
        """The tp shards of one stage: ``{"model": flat, "moments": {name: {key: tensor}}, "raw": shard}``
        (global layer numbers in both)."""
        if pp_rank not in self._stages:
            shards = []
            for t in range(self.tp_size):
                path = os.path.join(self.base, shard_dir_name(t, pp_rank, self.pp_size), SHARD_FILE)
                if not os.path.isfile(path):
                    raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
                raw = load_file(path, mmap=True)
                shards.append({"model": self._global_weights(raw, pp_rank, path),
                               "moments": self._global_moments(raw, pp_rank), "raw": raw})
            self._stages[pp_rank] = shards
        return self._stages[pp_rank]

    def _global_weights(self, raw: dict, pp_rank: int, path: str) -> dict[str, torch.Tensor]:
        entries = chunk_entries(raw, path)
        if len(entries) != self.virtual_pp_size:
            raise CheckpointError(f"{path} holds {len(entries)} model chunk(s), its args say "
                                  f"virtual_pipeline_model_parallel_size={self.virtual_pp_size}")
        flat: dict[str, torch.Tensor] = {}
        for c, entry in enumerate(entries):  # stored numbers are local to the chunk (Megatron's)
            offset = self.split.chunk_layers(pp_rank, c).start
            flat.update({renumber(n, offset): t for n, t in gpt_flat(entry, path, self.untied).items()})
        return flat

    def _global_moments(self, raw: dict, pp_rank: int) -> dict[str, dict[str, torch.Tensor]]:
        return {self.global_param_name(n, pp_rank): m for n, m in _moments_by_name(raw).items()}

    def global_param_name(self, name: str, pp_rank: int) -> str:
        """A saved optimizer name (ParallelModel.named_parameters: local to the stage without
        interleaving, already global with it) with its global layer number."""
        offset = 0 if self.virtual_pp_size > 1 else self.split.chunk_layers(pp_rank).start
        return renumber(name, offset)

    def locate(self, global_name: str) -> tuple[int, str]:
        """(source pp rank, name in its tables) of a parameter given its global name."""
        index = layer_index(global_name)
        if index is not None:
            return self.split.locate(index)[0], global_name
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
        if not torch.is_tensor(parts[0]):
            return parts[0]
        return merge_tp(parts, kind(local, self.swiglu))


class MergedSource:
    """A checkpoint already merged into full tensors (GPT names, global layers): Megatron-core's
    torch_dist format stores them so. Weights only: it carries no optimizer state Slipway reads."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def full(self, global_name: str, key: str | None = None) -> torch.Tensor:
        if key is not None:
            raise CheckpointError("this checkpoint's optimizer state is not read (torch_dist): load it "
                                  "with checkpoint.load=model-only")
        name = WORD if global_name == HEAD else global_name
        if name not in self.state:
            raise CheckpointError(f"{global_name} is not in the checkpoint: it does not match this model")
        return self.state[name]


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
    split = kind(local_name, target.swiglu)
    if split == VOCAB:
        full = _fit_vocab(full, target.padded_vocab_size)
    if DIM[split] is None or target.tp_size == 1 or full.dim() == 0:
        return full.clone()
    return split_tp(full, split, target.tp_size)[target.tp_rank].clone()


def reshard_model(src: SourceCheckpoint | MergedSource, local_names: list[str], target: Target
                  ) -> dict[str, torch.Tensor]:
    """Flat local-name → tensor dict for the target rank's parameters."""
    return {n: target_slice(src.full(renumber(n, target.layer_start)), n, target) for n in local_names}


def reshard_moments(src: SourceCheckpoint, local_names: list[str], target: Target
                    ) -> dict[str, dict[str, torch.Tensor]]:
    """Per target parameter, its optimizer state entries resharded (scalars such as ``step`` copied)."""
    out = {}
    for n in local_names:
        g = renumber(n, target.layer_start)
        pp_rank, local = src.locate(g)
        keys = src.stage(pp_rank)[0]["moments"].get(local, {})
        out[n] = {k: (v if not torch.is_tensor(v) else v.clone() if v.dim() == 0
                      else target_slice(src.full(g, k), n, target)) for k, v in keys.items()}
    return out
