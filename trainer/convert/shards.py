"""Merging a (tp, pp) checkpoint into one full state and splitting one back, Megatron names throughout.

A *full* state is flat Megatron names (``names.RULES``) with global layer indices and the padded vocab.
Merging follows ``formats.md`` §4 by the trainer's one sharding table (``trainer.parallel.sharding``):
column-parallel tensors (QKV, h→4h, word embeddings) concatenate on
dim 0, row-parallel weights on dim 1, everything else is replicated. Megatron numbers layers locally
within each pipeline stage (stage k holds global layers k·L/p… as local 0…L/p−1, or with Megatron's uneven
split the counts its stages hold); checkpoints that use global numbers are accepted too. Interleaved
checkpoints (v model chunks per stage: ``model0`` … entries, ``trainer.checkpoint.chunks``) number layers
locally within each chunk; chunk c of stage r holds ``PipelineSplit.chunk_layers(r, c)`` of the split the
args record (``trainer.checkpoint.chunks.saved_split``). Stages are read one at a time and memory-mapped,
so merging needs about one copy of the model in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.chunks import chunk_entries, saved_split
from trainer.checkpoint.files import CHECKPOINT_VERSION, arg, iter_dir_name, write_tracker
from trainer.convert import dist, names
from trainer.convert.mcore import is_mcore_model, normalise_names, untied_head
from trainer.convert.shard_io import (
    SHARD_FILE,
    CheckpointError,
    discover_layout,
    flatten,
    load_shard,
    nest,
    save_shard,
    shard_dir_name,
)
from trainer.convert.spec import check_convertible
from trainer.formulas import PipelineSplit
from trainer.log import get_logger
from trainer.model.names import layer_index, renumber
from trainer.parallel import sharding

log = get_logger(__name__)


@dataclass
class MergedCheckpoint:
    """One checkpoint merged into a single full state."""

    state: dict[str, torch.Tensor]  # flat Megatron names, global layers, padded vocab, source dtype
    args: Any  # the checkpoint's args: a dict (Slipway) or an argparse Namespace (Megatron-LM)
    iteration: int | str
    checkpoint_version: float
    tp_size: int
    pp_size: int


def _entry_model(model: Any, path: Path, untied: bool) -> dict[str, torch.Tensor]:
    """The flat, normalised names of one model entry (legacy nested or Megatron-core flat)."""
    mcore = is_mcore_model(model)
    return normalise_names(model if mcore else flatten(model), mcore, path, untied)


def _stage_model(shard: dict[str, Any], path: Path, pp_rank: int, pp_size: int) -> tuple[dict, bool]:
    """One shard's flat model and whether it is interleaved; an interleaved shard's chunks are merged
    with their layers made global (they are numbered locally per chunk), refusing what is not a GPT."""
    entries = chunk_entries(shard, path)
    untied = untied_head(shard.get("args"))
    if len(entries) == 1:
        return _entry_model(entries[0], path, untied), False
    chunks = [_entry_model(e, path, untied) for e in entries]
    v = len(chunks)
    per = len({i for n in chunks[0] if (i := layer_index(n)) is not None})
    args = shard.get("args")  # the split its args record (Megatron's uneven one too), else the even one
    split = saved_split(args) if arg(args, "num_layers") else PipelineSplit(per * pp_size * v, pp_size, v)
    merged: dict[str, torch.Tensor] = {}
    for c, chunk in enumerate(chunks):
        if sorted({i for n in chunk if (i := layer_index(n)) is not None}) != list(range(per)):
            raise CheckpointError(f"{path}: model{c} does not hold layers 0…{per - 1} like model0 (Megatron "
                                  "numbers each chunk's layers locally): inconsistent interleaved checkpoint")
        offset = split.chunk_layers(pp_rank, c).start
        merged.update(_renumber(chunk, offset))
    return merged, True


def _merge_tp(parts: list[dict[str, torch.Tensor]], path: Path, swiglu: bool) -> dict[str, torch.Tensor]:
    """One stage's TP shards → one stage state (local layer numbers kept; SwiGLU's [gate_r; up_r] shards
    back to [gate; up] by the sharding table's merge)."""
    if any(p.keys() != parts[0].keys() for p in parts):
        raise CheckpointError(f"TP shards under {path} hold different parameter names: corrupted checkpoint")
    merged = {}
    for name in parts[0]:
        tensors = [p[name] for p in parts]
        kind = sharding.kind(name, swiglu)
        if sharding.DIM[kind] is not None:
            merged[name] = sharding.merge_tp(tensors, kind)
        else:
            if any(not torch.equal(t, tensors[0]) for t in tensors[1:]):
                log.warning("replicated %s differs across TP ranks under %s; using TP rank 0", name, path)
            # With TP > 1 everything else is a fresh concatenation: copying these few small tensors
            # too lets the memory-mapped shard files be unmapped once the stage is merged.
            merged[name] = tensors[0].clone() if len(tensors) > 1 else tensors[0]
    return merged


def _layer_offsets(stage_layers: list[list[int]]) -> list[int]:
    """Per stage, the number to add to stored layer indices to make them global."""
    counts = [len(s) for s in stage_layers]
    if all(s == list(range(len(s))) for s in stage_layers):  # Megatron: local numbering per stage
        return [sum(counts[:k]) for k in range(len(counts))]
    flat = [i for s in stage_layers for i in s]
    if flat == list(range(len(flat))):  # already global
        return [0] * len(stage_layers)
    raise CheckpointError(f"pipeline stages hold layers {stage_layers}: neither local 0…n−1 per stage nor "
                          "one global 0…L−1 sequence; the checkpoint is inconsistent")


def _renumber(state: dict[str, torch.Tensor], offset: int) -> dict[str, torch.Tensor]:
    if not offset:
        return state
    return {renumber(name, offset): tensor for name, tensor in state.items()}


def load_merged(iter_dir: Path, iteration: int | str, trust_pickle: bool = False) -> MergedCheckpoint:
    """Read one iteration folder — the torch format (legacy or Megatron-core names, any tp × pp) or
    Megatron-core's torch_dist — and merge TP and PP into a single full state in Slipway's names."""
    if dist.is_dist(iter_dir):
        flat, meta = dist.load_dist(iter_dir, trust_pickle)
        check_convertible(meta["args"])  # before the names: an unknown name is only a symptom of the option
        state = normalise_names(flat, mcore=True, where=iter_dir, untied=untied_head(meta["args"]))
        tp_size, pp_size = (int(arg(meta["args"], k, 1)) for k in ("tensor_model_parallel_size",
                                                                           "pipeline_model_parallel_size"))
        head = state.pop(names.HEAD_EMBEDDINGS, None)
    else:
        tp_size, pp_size = discover_layout(iter_dir)
        state, meta, head = _merge_stages(iter_dir, tp_size, pp_size, trust_pickle)
    num_layers = 1 + max((i for n in state if (i := layer_index(n)) is not None), default=-1)
    missing = [n for n in names.expected_megatron_names(num_layers, names.features(meta["args"]))
               if n not in state]
    if missing:
        raise CheckpointError(f"{iter_dir} is incomplete: no {missing[:4]}{' …' if len(missing) > 4 else ''}"
                              f" in any of its {tp_size * pp_size} shards")
    _check_head(state, head, iter_dir)
    version = float(meta["checkpoint_version"] or 0.0)
    return MergedCheckpoint(state, meta["args"], meta["iteration"] or iteration, version, tp_size, pp_size)


def _merge_stages(iter_dir: Path, tp_size: int, pp_size: int, trust_pickle: bool
                  ) -> tuple[dict[str, torch.Tensor], dict[str, Any], torch.Tensor | None]:
    """The torch format: every shard read (memory-mapped), TP merged per stage, stages renumbered."""
    stages, meta, interleaved = [], None, False
    for pp in range(pp_size):
        parts = []
        for tp in range(tp_size):
            path = iter_dir / shard_dir_name(tp, pp, pp_size) / SHARD_FILE
            shard = load_shard(path, trust_pickle)
            if meta is None:  # keep only what is needed: the rest (optimizer state) stays unread on disk
                meta = {k: shard.get(k) for k in ("args", "checkpoint_version", "iteration")}
                check_convertible(meta["args"])
            part, interleaved = _stage_model(shard, path, pp, pp_size)
            parts.append(part)
            del shard
        swiglu = bool(arg(meta["args"], "swiglu", False))
        stages.append(_merge_tp(parts, iter_dir / shard_dir_name(0, pp, pp_size), swiglu))
    layers = [sorted({i for n in s if (i := layer_index(n)) is not None}) for s in stages]
    offsets = [0] * pp_size if interleaved else _layer_offsets(layers)  # interleaved: already global
    state: dict[str, torch.Tensor] = {}
    head = None
    for stage, offset in zip(stages, offsets, strict=True):
        head = stage.pop(names.HEAD_EMBEDDINGS, head)
        state.update(_renumber(stage, offset))
    return state, meta, head


def _check_head(state: dict[str, torch.Tensor], head: torch.Tensor | None, where: Path) -> None:
    """The last stage's LM-head copy must equal the first stage's embedding (the head is tied)."""
    if head is None:
        return
    emb = state[names.WORD_EMBEDDINGS]
    if head.shape != emb.shape:
        raise CheckpointError(f"{where}: word_embeddings_for_head {tuple(head.shape)} does not match the "
                              f"word embeddings {tuple(emb.shape)}")
    if not torch.equal(head, emb):
        diff = (head.float() - emb.float()).abs().max().item()
        log.warning("%s: the last stage's tied LM head differs from the embedding by up to %.3g; "
                    "Hugging Face ties them, so the embedding is used for both", where, diff)


def split(state: dict[str, torch.Tensor], tp_size: int, pp_size: int, swiglu: bool = False
          ) -> dict[tuple[int, int], dict]:
    """A full state → {(tp_rank, pp_rank): flat stage state with local layer numbers}, Megatron style
    (``swiglu``: the MLP's first matrix splits as the sharding table's GLU kind)."""
    num_layers = 1 + max(i for n in state if (i := layer_index(n)) is not None)
    sharding.layers_per_stage(num_layers, pp_size)  # refuses a pp that does not divide the layers
    shards: dict[tuple[int, int], dict] = {(t, p): {} for t in range(tp_size) for p in range(pp_size)}
    for name, tensor in state.items():
        rule, i = names.match(name)
        if rule.stage == names.LAYER:
            stage, local_i = sharding.stage_of_layer(i, num_layers, pp_size)
            stages, local = [stage], renumber(name, local_i - i)
        else:
            stages, local = [0 if rule.stage == names.FIRST else pp_size - 1], name
        if name == names.WORD_EMBEDDINGS and pp_size > 1 and names.OUTPUT_LAYER not in state:
            stages.append(pp_size - 1)  # the tied head's copy on the last stage
        for t, piece in enumerate(_split_tp(tensor, name, tp_size, swiglu)):
            for p in stages:
                key = names.HEAD_EMBEDDINGS if p != stages[0] else local
                shards[(t, p)][key] = piece
    return shards


def _split_tp(tensor: torch.Tensor, name: str, tp_size: int, swiglu: bool) -> list[torch.Tensor]:
    kind = sharding.kind(name, swiglu)
    if sharding.DIM[kind] is None:
        return [tensor.clone() for _ in range(tp_size)]
    try:
        pieces = sharding.split_tp(tensor, kind, tp_size)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    # clone: a saved view would drag the whole unsplit storage into every shard file.
    return [c.clone() for c in pieces]


def write_checkpoint(checkpoint_dir: Path, state: dict[str, torch.Tensor], args: Any,
                     iteration: int, layout: tuple[int, int]) -> Path:
    """Write ``state`` as a Megatron legacy checkpoint at ``layout`` = (tp, pp); returns its iteration dir."""
    tp_size, pp_size = layout
    iter_dir = checkpoint_dir / iter_dir_name(iteration)
    for (tp, pp), stage in split(state, tp_size, pp_size, bool(arg(args, "swiglu", False))).items():
        payload = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                   "model": nest(stage)}
        save_shard(iter_dir / shard_dir_name(tp, pp, pp_size) / SHARD_FILE, payload)
    write_tracker(str(checkpoint_dir), iteration)
    return iter_dir
