"""``checkpoint.format=torch_dist``: this rank's share of a Megatron-core distributed checkpoint, and a
resume from one (weights and Adam state, at any (tp, pp): the tensors are stored at their global shape).

What Megatron-core's ``GPTModel.sharded_state_dict()`` asks for, and so what each rank writes
(:class:`~trainer.checkpoint.dist_write.Piece`): every parameter under its Megatron-core name, a layer's
under the stacked key ``decoder.layers.X`` (leading dimension: the global layer number; norms under
Transformer-Engine-style names: ``trainer.convert.names.to_dist``), each rank's tp shard at its offset
(:mod:`trainer.parallel.sharding`'s split dims); a replicated tensor once (tp rank 0: Megatron's main
replica), nothing from dp ranks > 0; an ``_extra_state`` object (None) per linear module and layer; the
RNG states per (pp, tp) rank as ``rng_state``. The tied head's last-stage copy is not stored (Megatron
stores the word embeddings only).

Slipway's own additions, which Megatron ignores when it loads the model: the Adam moments (and the
distributed optimizer's fp32 masters) as ``optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<key>`` with
the parameter's shape and offsets (Megatron's names for per-parameter optimizer tensors), and in
``common.pt`` the step, the loss scaler and the loop's counters. Megatron-LM therefore loads such a
checkpoint with ``--no-load-optim`` (its optimizer layout is its own); Slipway resumes from it fully.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import protocol as ckpt
from trainer.checkpoint.chunks import saved_split
from trainer.checkpoint.dist_write import Piece, save_dist_checkpoint
from trainer.checkpoint.files import CheckpointError, arg
from trainer.convert import dist as dist_ckpt
from trainer.convert import names
from trainer.convert.mcore import EXTRA, LEGACY_PREFIX, LINEARS, normalise_names, untied_head
from trainer.log import get_logger
from trainer.model.names import nest, renumber
from trainer.parallel import ParallelModel
from trainer.parallel.sharding import DIM, GLU, kind
from trainer.restore import reshard
from trainer.restore.distrib_optim import gather_state, is_distributed, load_by_name, step_of
from trainer.restore.state import Restorable, TrainState, load_targets, param_names, train_state_from

log = get_logger(__name__)

OPTIM = dist_ckpt.OPTIMIZER + "state."
# Slipway's optimizer-state names → Megatron's (``param``: the distributed optimizer's fp32 master).
STATE_KEYS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "param": "fp32_param"}


def optimizer_by_name(model: ParallelModel, optimizer: Any) -> tuple[dict[str, dict], int]:
    """({model parameter name: {exp_avg, exp_avg_sq[, param]}}, step) on dp rank 0 ({} elsewhere).
    Collective over dp with the distributed optimizer (its state is gathered as for distrib_optim.pt)."""
    if is_distributed(optimizer):
        content = gather_state(optimizer)
        return ({}, 0) if content is None else (content["state"], int(content["step"]))
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state, step = {}, 0
    for name, p in zip(param_names(model, optimizer), params, strict=True):
        s = optimizer.state.get(p) or {}
        if "exp_avg" in s:
            state[name] = {k: s[k] for k in ("exp_avg", "exp_avg_sq")}
            step = max(step, step_of(s))
    return state, step


def _chunks(key: str, t: torch.Tensor, split: str, model: ParallelModel, layer: int | None,
            num_layers: int) -> list[Piece]:
    """This rank's tp shard ``t`` of ``key`` as pieces at their global offsets (GLU: two blocks, as rank
    r holds [gate_r; up_r] of the full [gate; up])."""
    tp, r, d = model.pstate.tp_size, model.pstate.tp_rank, DIM[split]
    t, zeros, shape = t.detach(), [0] * t.dim(), list(t.shape)
    if split == GLU:
        half = t.shape[0] // 2
        parts = [(t[:half], [r * half, *zeros[1:]]), (t[half:], [(tp + r) * half, *zeros[1:]])]
    else:
        parts = [(t, [r * t.shape[d] if i == d else 0 for i in range(t.dim())])]
    if d is not None:
        shape[d] *= tp
    if layer is not None:  # stacked: one global tensor over all layers
        parts, shape = [(x.unsqueeze(0), [layer, *o]) for x, o in parts], [num_layers, *shape]
    return [Piece(key, x, tuple(o), tuple(shape)) for x, o in parts]


def pieces(model: ParallelModel, opt_state: dict[str, dict], rng_states: list[dict]) -> list[Piece]:
    """What this rank writes (see the module docstring): nothing on dp ranks > 0."""
    ps = model.pstate
    if ps.dp_rank != 0:
        return []
    out = []
    for chunk in model.chunks:
        swiglu, num_layers = chunk.cfg.activation == "swiglu", chunk.cfg.num_layers
        for n, p in chunk.named_parameters():
            split = kind(n, swiglu)
            if n == names.HEAD_EMBEDDINGS or (DIM[split] is None and ps.tp_rank != 0):
                continue  # the tied head's copy / a replica: Megatron stores one copy
            key, i = names.to_dist(names.to_mcore(LEGACY_PREFIX + n))
            layer = None if i is None else chunk.stage.layer_start + i
            out += _chunks(key, p, split, model, layer, num_layers)
            saved = opt_state.get(n if len(model.chunks) == 1 else chunk.global_name(n), {})
            for k, t in saved.items():
                out += _chunks(f"{OPTIM}{STATE_KEYS[k]}.{key}", t, split, model, layer, num_layers)
        if ps.tp_rank == 0:  # Megatron's ShardedObject keys: {key}/shard_{offset}_{global shape}
            out += [Piece(f"{names.MCORE_LAYERS}{m}{EXTRA}/shard_{g}_{num_layers}", [None])
                    for g in range(chunk.stage.layer_start, chunk.stage.layer_end) for m in LINEARS]
    out.append(Piece(rng_key(ps), [rng_states]))
    return out


def rng_key(ps: Any) -> str:
    """Megatron's ShardedObject key of a (pp, tp) rank's RNG states (all its dp ranks' in one list)."""
    return f"rng_state/shard_{ps.pp_rank}.{ps.tp_rank}_{ps.pp_size}.{ps.tp_size}"


def dist_content(model: ParallelModel, parts: Restorable, args: Any, state: TrainState,
                 config: dict) -> tuple[list[Piece], dict]:
    """Collective over all ranks: this rank's pieces and ``common.pt`` (what rank 0 writes) of the
    checkpoint of ``state.iteration``."""
    ps = model.pstate
    opt_state, step = optimizer_by_name(model, parts.optimizer)
    rng = ckpt.gather_rng_states(model.tracker.state_dict(), ps.dp_group.pg, ps.dp_size)
    common = {"args": args, "checkpoint_version": ckpt.CHECKPOINT_VERSION, "iteration": state.iteration,
              "opt_param_scheduler": parts.scheduler.state_dict(),
              "slipway": {"optimizer_step": step, "grad_scaler": parts.scaler.state_dict(),
                          "skipped_iters": state.skipped_iters, "nan_iters": state.nan_iters,
                          "config": config, "log_window": state.log_window}}
    return pieces(model, opt_state, rng), common


def save_torch_dist(ckpt_dir: str, keep: int | None, model: ParallelModel, parts: Restorable, args: Any,
                    state: TrainState, config: dict) -> bool:
    """Collective over all ranks: the checkpoint of ``state.iteration`` in torch_dist, committed by the
    save protocol (:func:`trainer.checkpoint.dist_write.save_dist_checkpoint`)."""
    ps = model.pstate
    layout = ckpt.ShardLayout(ps.tp_rank, ps.pp_rank, ps.tp_size, ps.pp_size, ps.dp_rank, ps.dp_size)
    mine, common = dist_content(model, parts, args, state, config)
    return save_dist_checkpoint(ckpt_dir, state.iteration, mine, common, layout, keep)


def _sources(iter_dir: Path, common: dict, with_optimizer: bool) -> dict[str, reshard.MergedSource]:
    """"" → the weights, and each optimizer-state name → its tensors, merged and in Slipway's names."""
    args = common.get("args")
    num_layers, untied = int(arg(args, "num_layers")), untied_head(args)
    tensors = dist_ckpt.read_tensors(iter_dir, keep=lambda k: with_optimizer or not k.startswith(OPTIM))
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        state = next((s for s, m in STATE_KEYS.items() if key.startswith(f"{OPTIM}{m}.")), "")
        groups.setdefault(state, {})[key.removeprefix(f"{OPTIM}{STATE_KEYS.get(state, '')}.")] = t
    return {s: reshard.MergedSource({n.removeprefix(LEGACY_PREFIX): t for n, t in normalise_names(
                dist_ckpt.unstack(g, num_layers), True, iter_dir, untied).items()})
            for s, g in groups.items()}


def _restore_rng(iter_dir: Path, args: Any, model: ParallelModel) -> None:
    ps = model.pstate
    saved = tuple(arg(args, k) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                         "data_parallel_size"))
    split = saved_split(args)
    if saved != (ps.tp_size, ps.pp_size, ps.dp_size) or split != model.pcfg.split(split.num_layers):
        log.warning("the checkpoint was saved at (tp, pp, dp) = %s, this run is (%d, %d, %d): its RNG states "
                    "are not restored, so dropout masks differ from an uninterrupted run's", saved,
                    ps.tp_size, ps.pp_size, ps.dp_size)
        return
    states = dist_ckpt.read_object(iter_dir, rng_key(ps))[0]
    model.tracker.load_state_dict(ckpt.set_rng_state(states[ps.dp_rank]))


def restore_dist(iter_dir: Path, model: ParallelModel, parts: Restorable | None) -> TrainState:
    """A torch_dist checkpoint Slipway wrote, at any (tp, pp, dp): weights, and with ``parts`` the Adam
    state, schedule, loss scaler, counters and (at the saved layout: they belong to its ranks) the RNG
    states, so that a resume at the saved layout continues bit for bit."""
    common = dist_ckpt.read_common(iter_dir)
    extra = common.get("slipway") or {}
    if parts is not None and "optimizer_step" not in extra:
        raise CheckpointError(f"{iter_dir} is a torch_dist checkpoint without Slipway's optimizer state "
                              "(written by Megatron-LM): Slipway starts from its weights only; set "
                              "checkpoint.load=model-only and checkpoint.load_dir to its directory")
    sources = _sources(iter_dir, common, parts is not None)
    targets = load_targets(model)
    for c, (local, target) in enumerate(targets):
        model.load_megatron_state_dict(nest(reshard.reshard_model(sources[""], local, target)), c)
    if parts is None:
        return TrainState()
    by_name = {}
    for c, (local, target) in enumerate(targets):
        for n in local:
            g = renumber(n, target.layer_start)
            by_name[n if len(targets) == 1 else model.chunks[c].global_name(n)] = {
                k: reshard.target_slice(src.full(g), n, target) for k, src in sources.items() if k}
    names_ = param_names(model, parts.optimizer)
    with torch.no_grad():  # a plain optimizer takes saved fp32 masters as its weights, in place
        load_by_name(parts.optimizer, names_, by_name, extra["optimizer_step"], model)
    parts.scheduler.load_state_dict(common["opt_param_scheduler"])
    scaler = extra.get("grad_scaler")
    if parts.scaler.dynamic and scaler and "growth_tracker" in scaler:
        parts.scaler.load_state_dict(scaler)
    _restore_rng(iter_dir, common.get("args"), model)
    log.info("resumed from torch_dist checkpoint %s (iteration %s) at tp=%d pp=%d dp=%d", iter_dir,
             common.get("iteration"), model.pstate.tp_size, model.pstate.pp_size, model.pstate.dp_size)
    return train_state_from(common)
