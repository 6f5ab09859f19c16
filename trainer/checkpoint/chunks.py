"""Interleaved (virtual pipeline) checkpoints: where a shard keeps each model chunk's weights.

Megatron-LM saves a rank that holds v > 1 model chunks with one entry per chunk, ``model0``, ``model1``,
… instead of ``model`` (``save_checkpoint``: ``state_dict['model%d' % i]``), each in the usual nested
(legacy) or flat (Megatron-core) naming, with layer numbers local to the chunk (0 … L/(p·v) − 1, the
ModuleList index of that chunk); ``args.virtual_pipeline_model_parallel_size`` is v (None without
interleaving). Chunk c of rank r holds layers ``trainer.formulas.PipelineSplit.chunk_layers(r, c)`` of the
split :func:`saved_split` reads from the args.
"""

from __future__ import annotations

import re
from typing import Any

from trainer.checkpoint.files import CheckpointError, arg
from trainer.formulas import PipelineSplit

_CHUNK_KEY = re.compile(r"^model(\d+)$")


def model_keys(virtual_pp_size: int) -> list[str]:
    """The shard keys of a rank's chunks: ``["model"]`` without interleaving, else model0 … model{v−1}."""
    return ["model"] if virtual_pp_size == 1 else [f"model{c}" for c in range(virtual_pp_size)]


def chunk_entries(shard: Any, where: object) -> list[Any]:
    """A shard's model entries in chunk order (one without interleaving); refuses anything else."""
    if isinstance(shard, dict) and "model" in shard:
        return [shard["model"]]
    found = sorted(int(m.group(1)) for k in (shard if isinstance(shard, dict) else ())
                   if isinstance(k, str) and (m := _CHUNK_KEY.match(k)))
    if not found:
        keys = sorted(shard)[:8] if isinstance(shard, dict) else type(shard).__name__
        raise CheckpointError(f"{where} has no 'model' entry (found {keys}): not a Megatron/Slipway "
                              "checkpoint")
    if found != list(range(len(found))):
        raise CheckpointError(f"{where} holds interleaved chunks {[f'model{c}' for c in found]}, not "
                              "model0 … model{v-1}: the checkpoint is incomplete or corrupted")
    saved = virtual_size(shard.get("args"))
    if saved not in (1, len(found)):  # 1: args without the field (Megatron writes it; older tools not)
        raise CheckpointError(f"{where} has {len(found)} model chunks but its args say "
                              f"virtual_pipeline_model_parallel_size={saved}: inconsistent checkpoint")
    return [shard[f"model{c}"] for c in found]


def virtual_size(args: Any) -> int:
    """v of a saved checkpoint's args (Megatron: None without interleaving)."""
    return int(arg(args, "virtual_pipeline_model_parallel_size", None) or 1)


def saved_split(args: Any) -> PipelineSplit:
    """How a saved checkpoint's layers split over its stages and chunks: its args' pipeline size, v, and
    Megatron's uneven split (decoder_first/last_pipeline_num_layers; None: even)."""
    return PipelineSplit(int(arg(args, "num_layers")), int(arg(args, "pipeline_model_parallel_size", 1) or 1),
                         virtual_size(args), arg(args, "decoder_first_pipeline_num_layers"),
                         arg(args, "decoder_last_pipeline_num_layers"))
