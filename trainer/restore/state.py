"""What a training checkpoint holds and how it is put back: the bridge between the loop and
``trainer.checkpoint`` (file layout, atomic protocol) and ``trainer.restore.reshard`` (layout changes).

``args`` is an ``argparse.Namespace`` of plain values under Megatron's names
(:func:`trainer.checkpoint.megatron_args.megatron_args`: what Megatron-LM and transformers read, plus the
architecture's fixed values), with the run's own facts added:

    num_layers, hidden_size, ffn_hidden_size, num_attention_heads, kv_channels, seq_length,
    max_position_embeddings, vocab_size (the tokenizer's), padded_vocab_size, make_vocab_size_divisible_by,
    the architecture (ModelConfig.megatron_architecture: norm_epsilon, rope, RMSNorm, SwiGLU, GQA, biases,
    untied head), hidden_dropout, attention_dropout, init_method_std, tensor_model_parallel_size,
    pipeline_model_parallel_size, virtual_pipeline_model_parallel_size and
    num_layers_per_virtual_pipeline_stage (None without interleaving), decoder_first/last_pipeline_num_layers
    and num_virtual_stages_per_pipeline_rank (Megatron's uneven split; None when even), data_parallel_size,
    world_size,
    sequence_parallel, micro_batch_size, global_batch_size, train_iters, iteration,
    consumed_train_samples, consumed_valid_samples, fp16, bf16,
    seed, lr, min_lr, lr_decay_style, lr_warmup_iters, lr_decay_iters, weight_decay, adam_beta1,
    adam_beta2, adam_eps, clip_grad, tokenizer_type, vocab_file, merge_file, tokenizer_model (the
    HuggingFaceTokenizer directory, Megatron's name), eod_token_id, data_path,
    split, kernels, slipway_attention_backend, run_id, run_dir, slipway_version, slipway_tokenizer_digest
    (the tokenizer's content digest: trainer.data.tokenizer_identity).

With interleaving the shard holds ``model0`` … ``model{v-1}`` instead of ``model`` (Megatron's layout,
:mod:`trainer.checkpoint.chunks`). Checkpoints of older Slipway versions carry a dict; everything here
reads args through :func:`trainer.checkpoint.files.arg`, which takes both.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import trainer
from trainer.checkpoint import protocol as ckpt
from trainer.checkpoint.chunks import chunk_entries, model_keys, saved_split, virtual_size
from trainer.checkpoint.files import arg
from trainer.checkpoint.megatron_args import megatron_args
from trainer.config.model import ModelConfig
from trainer.convert.mcore import LEGACY_PREFIX, gpt_flat, to_mcore_model
from trainer.convert.shards import load_merged
from trainer.data.tokenizer_identity import DIGEST_ARG, TokenizerId, resume_refusal, unrecorded_note
from trainer.log import get_logger
from trainer.model.names import nest
from trainer.optim.lr import OptimizerParamScheduler
from trainer.optim.precision import LossScaler, uses_master_weights
from trainer.parallel import ParallelModel
from trainer.restore import reshard
from trainer.restore.distrib_optim import DistribSource, is_distributed, load_optimizer, load_resharded

log = get_logger(__name__)


@dataclass
class TrainState:
    """The loop's position; saved in every checkpoint (``args`` and ``slipway``). Defined here, not beside
    the loop in ``trainer.run.loop``: restoring builds it, and ``trainer.run`` imports this package, so
    the state's home must be the side that does not import the other."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iters: int = 0
    nan_iters: int = 0
    # The log window in progress at a save (trainer.run.metrics.IntervalStats as a dict): a resume in the
    # middle of a log interval continues the window, so the first logged loss after it is the
    # uninterrupted run's.
    log_window: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RunFacts:
    """The run-level values ``args`` records besides the model shape and the loop position."""

    config: dict  # RunConfig.to_dict()
    global_batch_size: int
    eod_token_id: int | None
    run_id: str | None
    tokenizer_digest: str | None = None  # trainer.data.tokenizer_identity: recorded in every checkpoint


def checkpoint_args(gpt: ModelConfig, model: ParallelModel, facts: RunFacts,
                    state: TrainState) -> argparse.Namespace:
    """Megatron-named ``args`` (plain values; see the module docstring)."""
    c, ps = facts.config, model.pstate
    t, o, tok = c["train"], c["optim"], c["tokenizer"]
    master = uses_master_weights(t["precision"], t.get("precision_recipe", "auto"),
                                 bool(o.get("distributed")))
    return megatron_args({
        "num_layers": gpt.num_layers, "hidden_size": gpt.hidden_size, "ffn_hidden_size": gpt.ffn_hidden_size,
        "num_attention_heads": gpt.num_attention_heads, "kv_channels": gpt.head_dim,
        "seq_length": gpt.seq_length, "max_position_embeddings": gpt.max_position_embeddings,
        "vocab_size": gpt.vocab_size, "padded_vocab_size": gpt.padded_vocab_size(ps.tp_size),
        "make_vocab_size_divisible_by": gpt.make_vocab_size_divisible_by,
        **gpt.megatron_architecture(), "hidden_dropout": gpt.hidden_dropout,
        "attention_dropout": gpt.attention_dropout, "init_method_std": gpt.init_std,
        "tensor_model_parallel_size": ps.tp_size, "pipeline_model_parallel_size": ps.pp_size,
        **_virtual_args(gpt, model), "data_parallel_size": ps.dp_size, "world_size": ps.world_size,
        "sequence_parallel": bool(c["parallel"]["sequence_parallel"]),
        "micro_batch_size": t["micro_batch_size"], "global_batch_size": facts.global_batch_size,
        "train_iters": t["iters"], "iteration": state.iteration,
        "consumed_train_samples": state.consumed_train_samples,
        "consumed_valid_samples": state.consumed_valid_samples,
        "fp16": t["precision"] == "fp16", "bf16": t["precision"] == "bf16",
        "seed": t["seed"], "lr": o["lr"], "min_lr": o["min_lr"], "lr_decay_style": o["decay_style"],
        "lr_warmup_iters": o["warmup_iters"], "lr_decay_iters": o["decay_iters"] or t["iters"],
        "weight_decay": o["weight_decay"], "adam_beta1": o["adam_beta1"], "adam_beta2": o["adam_beta2"],
        "adam_eps": o["adam_eps"], "clip_grad": o["clip_grad"], "tokenizer_type": tok["type"],
        "vocab_file": tok["vocab_file"], "merge_file": tok["merge_file"], "eod_token_id": facts.eod_token_id,
        "tokenizer_model": tok.get("model"),
        "data_path": list(c["data"]["paths"]), "split": c["data"]["split"], "kernels": c["kernels"],
        # Not Megatron's attention_backend (an AttnBackend enum since core_v0.11): Slipway's own choice.
        "slipway_attention_backend": gpt.attention_backend, "run_id": facts.run_id, "run_dir": c["run_dir"],
        "slipway_version": trainer.__version__,
        # Which tokenizer, by content (trainer.data.tokenizer_identity): a resume with another is refused.
        DIGEST_ARG: facts.tokenizer_digest,
        # The distributed optimizer (also the master_weights recipe's layout) keeps 16-bit weights; the
        # fp32 masters are in distrib_optim.pt.
        "use_distributed_optimizer": master or bool(o.get("distributed", False)),
        "params_dtype": {"bf16": "bfloat16", "fp16": "float16"}.get(t["precision"], "float32")
        if master else "float32",
        **_format_args(c["checkpoint"].get("format", "legacy")),
    })


def _format_args(fmt: str) -> dict:
    """Megatron-LM's checkpoint-format fields: Megatron-core names (mcore, torch_dist) load without
    --use-legacy-models; torch_dist is what --ckpt-format torch_dist (--use-dist-ckpt before 0.9) writes."""
    dist = fmt == "torch_dist"
    return {"use_legacy_models": fmt == "legacy", "use_dist_ckpt": dist,
            "ckpt_format": "torch_dist" if dist else "torch", "dist_ckpt_format": "torch_dist"}


def _virtual_args(gpt: ModelConfig, model: ParallelModel) -> dict:
    """Megatron's interleaving and uneven-split fields, None where unused (as Megatron writes them): with
    an uneven split the chunks differ in size, so Megatron-LM takes --num-virtual-stages-per-pipeline-rank
    instead of --num-layers-per-virtual-pipeline-stage."""
    split = model.pcfg.split(gpt.num_layers)
    v = split.virtual_pp_size
    even = v > 1 and not split.uneven
    return {"virtual_pipeline_model_parallel_size": v if v > 1 else None,
            "num_layers_per_virtual_pipeline_stage": gpt.num_layers // (split.pp_size * v) if even else None,
            "num_virtual_stages_per_pipeline_rank": v if v > 1 and split.uneven else None,
            "decoder_first_pipeline_num_layers": split.first, "decoder_last_pipeline_num_layers": split.last}


def param_names(model: ParallelModel, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the optimizer's index order (so moments can be resharded by name)."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for g in optimizer.param_groups for p in g["params"]]


@dataclass
class Restorable:
    """What a full resume restores besides the model."""

    optimizer: torch.optim.Optimizer
    scheduler: OptimizerParamScheduler
    scaler: LossScaler


def build_state(model: ParallelModel, parts: Restorable, args: Any, state: TrainState, config: dict) -> dict:
    """This rank's ``model_optim_rng.pt`` contents (RNG states gathered over data-parallel ranks)."""
    ps = model.pstate
    return {
        "args": args, "checkpoint_version": ckpt.CHECKPOINT_VERSION, "iteration": state.iteration,
        **_model_entries(model, config["checkpoint"].get("format", "legacy")),
        "optimizer": {"optimizer": parts.optimizer.state_dict(), "grad_scaler": parts.scaler.state_dict(),
                      "param_names": param_names(model, parts.optimizer)},
        "opt_param_scheduler": parts.scheduler.state_dict(),
        "rng_state": ckpt.gather_rng_states(model.tracker.state_dict(), ps.dp_group.pg, ps.dp_size),
        "slipway": {"skipped_iters": state.skipped_iters, "nan_iters": state.nan_iters, "config": config,
                    "log_window": state.log_window},
    }


def _model_entries(model: ParallelModel, fmt: str) -> dict:
    """This shard's weights in the configured naming (checkpoint.format): ``model``, or one entry per
    chunk ``model0`` … with interleaving (trainer.checkpoint.chunks), layer numbers local to each."""
    out = {}
    for c, (key, chunk) in enumerate(zip(model_keys(len(model.chunks)), model.chunks, strict=True)):
        if fmt == "mcore":
            flat = {n: p.detach() for n, p in chunk.named_parameters()}
            out[key] = to_mcore_model(flat, chunk.stage.post_process)
        else:
            out[key] = model.megatron_state_dict(c)
    return out


def _untied(model: ParallelModel) -> bool:
    """mcore's output_layer is the untied head, not a copy of the embeddings."""
    return not model.chunks[0].cfg.tie_word_embeddings


def load_model_entries(model: ParallelModel, shard: dict) -> None:
    """Weights from a shard's ``model`` (or ``model0`` … per chunk) in either naming (and any Megatron
    naming era)."""
    entries = chunk_entries(shard, "the checkpoint shard")
    if len(entries) != len(model.chunks):
        raise ckpt.CheckpointError(f"the shard holds {len(entries)} model chunk(s), this model "
                                   f"{len(model.chunks)} (parallel.virtual_pp_size): load it resharded")
    for c, entry in enumerate(entries):
        model.load_megatron_state_dict(nest(gpt_flat(entry, untied=_untied(model))), c)


def named_weights(model: ParallelModel, shard: dict) -> dict[str, torch.Tensor]:
    """A shard's weights flat, by the model's parameter names (global layer numbers with chunks)."""
    entries = chunk_entries(shard, "the checkpoint shard")
    flats = [gpt_flat(entry, untied=_untied(model)) for entry in entries]
    if len(flats) == 1:
        return flats[0]
    return {chunk.global_name(n): t for chunk, flat in zip(model.chunks, flats, strict=True)
            for n, t in flat.items()}


def check_tokenizer(args: Any, tok: TokenizerId, plan: tuple[str, int, bool]) -> None:
    """A checkpoint resumes only with the tokenizer it was trained with (its args record the digest:
    trainer.data.tokenizer_identity); checkpoint.load=model-only is the explicit way to start from weights
    of another one. A checkpoint without the record (Megatron-LM's, an older Slipway's) loads with a note."""
    ckpt_dir, iteration, model_only = plan
    saved = arg(args, DIGEST_ARG)
    if saved is None:
        log.warning("%s", unrecorded_note(ckpt_dir, iteration))
        return
    refusal = resume_refusal(saved, tok, ckpt_dir, iteration)
    if refusal and model_only:
        log.warning("checkpoint.load=model-only: starting from the weights of %s iteration %d, trained with "
                    "another tokenizer than this run's %s", ckpt_dir, iteration, tok.files)
    elif refusal:
        raise ckpt.CheckpointError(f"{refusal[0]}. Fix: {refusal[1]}")


def train_state_from(shard: dict) -> TrainState:
    args, extra = shard.get("args"), shard.get("slipway", {})
    return TrainState(iteration=int(shard["iteration"]),
                      consumed_train_samples=int(arg(args, "consumed_train_samples", 0)),
                      consumed_valid_samples=int(arg(args, "consumed_valid_samples", 0)),
                      skipped_iters=int(extra.get("skipped_iters", 0)),
                      nan_iters=int(extra.get("nan_iters", 0)),
                      log_window=dict(extra.get("log_window") or {}))


def _require_training_state(shard: dict) -> None:
    missing = [k for k in ("optimizer", "opt_param_scheduler") if not shard.get(k)]
    if missing:
        raise ckpt.CheckpointError(f"the checkpoint has no {' or '.join(missing)} (a converted or "
                                   "weights-only checkpoint?): it cannot resume training; start from its "
                                   "weights with "
                                   "checkpoint.load=model-only and checkpoint.load_dir=<its directory>")


def restore_same_layout(shard: dict, model: ParallelModel, parts: Restorable | None,
                        distrib: dict | None = None) -> TrainState:
    """Load this rank's own shard: exact resume (``parts`` None: weights only); ``distrib``: the
    ``distrib_optim.pt`` beside it, if any (either optimizer loads either form, at any dp)."""
    load_model_entries(model, shard)
    if parts is None:
        return TrainState()
    _require_training_state(shard)
    saved = shard["optimizer"]
    names = param_names(model, parts.optimizer)
    if saved.get("param_names") not in (None, names):
        raise ckpt.CheckpointError("the checkpoint's optimizer covers different parameters than this "
                                   "model (changed model or optimizer grouping?); load with "
                                   "checkpoint.load=model-only")
    load_optimizer(parts.optimizer, saved, names, distrib, model, named_weights(model, shard))
    _restore_common(shard, parts)
    rng = shard.get("rng_state") or []
    ps = model.pstate
    if len(rng) == ps.dp_size:
        model.tracker.load_state_dict(ckpt.set_rng_state(rng[ps.dp_rank]))
    else:
        log.warning("checkpoint has RNG states for %d data-parallel ranks, this run has %d: dropout "
                    "masks will differ from an uninterrupted run", len(rng), ps.dp_size)
    return train_state_from(shard)


def _restore_common(shard: dict, parts: Restorable) -> None:
    parts.scheduler.load_state_dict(shard["opt_param_scheduler"])
    scaler_state = shard["optimizer"].get("grad_scaler")
    if parts.scaler.dynamic and scaler_state and "growth_tracker" in scaler_state:
        parts.scaler.load_state_dict(scaler_state)


def restore_merged(iter_dir: Path, model: ParallelModel) -> TrainState:
    """Weights merged from every shard by the converter's reader (Megatron-core torch_dist), sliced for
    this rank at any layout; the optimizer, schedule and iteration start fresh
    (checkpoint.load=model-only)."""
    merged = load_merged(iter_dir, iter_dir.name)
    src = reshard.MergedSource({n.removeprefix(LEGACY_PREFIX): t for n, t in merged.state.items()})
    for c, (local, target) in enumerate(load_targets(model)):
        model.load_megatron_state_dict(nest(reshard.reshard_model(src, local, target)), c)
    log.warning("loaded the weights of checkpoint %s (iteration %s, tp=%d pp=%d) at tp=%d pp=%d", iter_dir,
                merged.iteration, merged.tp_size, merged.pp_size, model.pstate.tp_size, model.pstate.pp_size)
    return TrainState()


def load_targets(model: ParallelModel) -> list[tuple[list[str], reshard.Target]]:
    """Per model chunk: its (chunk-local) parameter names and what it holds."""
    ps, out = model.pstate, []
    for chunk in model.chunks:
        stage, cfg = chunk.stage, chunk.cfg
        out.append(([n for n, _ in chunk.named_parameters()],
                    reshard.Target(ps.tp_rank, ps.tp_size, stage.layer_start, stage.layer_end,
                                   stage.pre_process, stage.post_process, chunk.padded_vocab_size,
                                   cfg.activation == "swiglu", not cfg.tie_word_embeddings)))
    return out


def restore_resharded(ckpt_dir: str, iteration: int, saved: tuple[int, int, Any], model: ParallelModel,
                      parts: Restorable | None) -> TrainState:
    """Load from a checkpoint saved with another (tp, pp) layout: merge, re-slice (weights and Adam
    moments); RNG states are not carried over (they belong to the old layout's ranks)."""
    src_tp, src_pp, args = saved
    ps, src_v = model.pstate, virtual_size(args)
    targets = load_targets(model)
    first_target = targets[0][1]
    # DistribSource: a SourceCheckpoint that also reads distrib_optim.pt (distributed optimizer)
    src = DistribSource(ckpt_dir, iteration, src_tp, saved_split(args), first_target.swiglu,
                        first_target.untied)
    for c, (local, target) in enumerate(targets):
        model.load_megatron_state_dict(nest(reshard.reshard_model(src, local, target)), c)
    log.warning("resharded checkpoint iteration %d from tp=%d pp=%d v=%d to tp=%d pp=%d v=%d", iteration,
                src_tp, src_pp, src_v, ps.tp_size, ps.pp_size, len(model.chunks))
    if parts is None:
        return TrainState()
    first = src.stage(0)[0]["raw"]
    _require_training_state(first)
    moments = {}  # keyed by the model's parameter names (global with chunks: ParallelModel)
    for c, (local, target) in enumerate(targets):
        name = (lambda n: n) if len(targets) == 1 else model.chunks[c].global_name
        moments.update({name(n): m for n, m in reshard.reshard_moments(src, local, target).items()})
    names = param_names(model, parts.optimizer)
    if is_distributed(parts.optimizer) or first["optimizer"]["optimizer"].get("distributed"):
        load_resharded(parts.optimizer, names, moments, model)
    else:
        sd = parts.optimizer.state_dict()
        sd["state"] = {i: moments[n] for i, n in enumerate(names) if moments.get(n)}
        parts.optimizer.load_state_dict(sd)
    _restore_common(first, parts)
    return train_state_from(first)
