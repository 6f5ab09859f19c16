"""Jobs for the distributed-optimizer tests: the same 20 steps through trainer.run.loop.step with the
plain optimizer and with ``optim.distributed``, on one ParallelState (tests/parallel/harness.py's model,
data and schedule)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from tests.parallel import harness as H
from trainer.config import OptimConfig
from trainer.optim.lr import LRSchedule, OptimizerParamScheduler
from trainer.optim.optimizer import build_optimizer
from trainer.optim.precision import ScalerSettings, make_scaler
from trainer.parallel import ParallelConfig, ParallelState, build_model
from trainer.parallel.dist_optimizer import DistributedOptimizer
from trainer.run.loop import Loop, step

OPTIM = OptimConfig(lr=H.LR, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, clip_grad=H.MAX_NORM,
                    decay_style="constant")


@dataclass(frozen=True)
class Spec:
    distributed: bool
    precision: str = "fp32"
    overflow_at: int | None = None  # put an inf into DP rank 1's gradient shard at this step
    harness_groups: bool = False  # one decayed group (the reference record's plain AdamW)
    sequence_parallel: bool = False


def _loop(pstate: ParallelState, tp: int, pp: int, spec: Spec) -> Loop:
    pcfg = ParallelConfig(tp_size=tp, pp_size=pp, bucket_size_mb=0.01,
                          sequence_parallel=spec.sequence_parallel)
    model = build_model(H.CFG, pcfg, pstate, H.SEED, kernels=H.KERNELS)
    groups = [{"params": model.parameters(), "wd_mult": 1.0, "lr_mult": 1.0}] if spec.harness_groups \
        else None
    if spec.precision != "fp32":
        model.autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec.precision]
    if spec.distributed:
        dtype = model.autocast or torch.float32
        opt = DistributedOptimizer(model, OPTIM, "csrc", dtype, groups)
    else:
        opt, _ = build_optimizer(model.named_parameters(), OPTIM, "cpu", H.KERNELS)
    sched = OptimizerParamScheduler(opt, LRSchedule.from_iters(OPTIM, H.STEPS, H.GLOBAL_BATCH))
    scaler = make_scaler(spec.precision, ScalerSettings(initial_scale=2.0**10))
    return Loop(model=model, optimizer=opt, scheduler=sched, scaler=scaler, precision=spec.precision,
                clip_grad=OPTIM.clip_grad, global_batch_size=H.GLOBAL_BATCH, num_microbatches=0,
                train_iters=H.STEPS, train_data=None, valid_data=None, save=None, wandb=None, cadence=None,
                throughput=None)


def _params(model) -> dict[str, torch.Tensor]:
    return {model.module.global_name(n): p.detach().float().clone() for n, p in model.named_parameters()}


def _inject_overflow(model) -> None:
    """After the reduce-scatter: an inf in DP rank 1's own shard only (rank 0's shard stays finite)."""
    if model.pstate.dp_rank == 1:
        b = model.grads.buckets[0]
        start, _ = model.grads.shard_range(b)
        b.buffer[start] = math.inf


def train_record(pstate: ParallelState, tp: int, pp: int, spec: Spec) -> dict:
    loop = _loop(pstate, tp, pp, spec)
    model, ps = loop.model, pstate
    rec = {"coords": (ps.tp_rank, ps.pp_rank, ps.dp_rank), "losses": [], "norms": [], "applied": [],
           "overlap": [], "scales": []}
    if spec.overflow_at is not None:
        real = model.grads.finish

        def finish_and_inject():
            real()
            if len(rec["losses"]) == spec.overflow_at:
                _inject_overflow(model)
        model.grads.finish = finish_and_inject
    for i in range(H.STEPS):
        before = _params(model) if i == spec.overflow_at else None
        out = step(loop, H.microbatches(i, ps.dp_rank, ps.dp_size))
        rec["losses"].append(out.loss)
        rec["norms"].append(out.grad_norm)
        rec["applied"].append(out.applied)
        rec["scales"].append(loop.scaler.scale)
        rec["overlap"].append(model.grads.launched_in_backward)
        if before is not None:
            after = _params(model)
            rec["unchanged_at_overflow"] = all(torch.equal(before[k], after[k]) for k in before)
    rec["final"] = _params(model)
    rec["param_dtype"] = str(next(iter(model.parameters())).dtype)
    return rec


def job(ranks: list[int], tp: int, pp: int, specs: list[tuple[str, Spec]], outdir: str) -> None:
    """Every spec, one after the other, on one ParallelState over ``ranks``; one file per (spec, rank)."""
    pstate = ParallelState.build(tp, pp, ranks)
    for tag, spec in specs:
        rec = train_record(pstate, tp, pp, spec)
        torch.save(rec, os.path.join(outdir, f"{tag}.{H.position(ranks)}.pt"))
    pstate.destroy()


def comm_job(ranks: list[int], outdir: str) -> None:
    """The shard collectives, native and emulated, sync and async, fp32 and bf16, on a DP group."""
    pstate = ParallelState.build(1, 1, ranks)
    from trainer.parallel import comm

    g, out = pstate.dp_group, {}
    for dtype in (torch.float32, torch.bfloat16):
        for emulate in (False, True):
            for async_op in (False, True):
                x = contribution(g.index, dtype)
                comm.reduce_scatter_shard(x, g, async_op=async_op, emulate=emulate).wait()
                start, end = comm.shard_range(x.numel(), g.size, g.index)
                y = torch.full_like(x, -1.0)
                y[start:end] = x[start:end]
                comm.all_gather_shard(y, g, async_op=async_op, emulate=emulate).wait()
                out[(str(dtype), emulate, async_op)] = (x[start:end].clone(), y)
    torch.save(out, os.path.join(outdir, f"comm.{g.index}.pt"))
    pstate.destroy()


def contribution(index: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``index``'s buffer for comm_job: 4·6 small integers (exact in bf16 when summed)."""
    return (torch.arange(24, dtype=torch.float32) * (index + 1) % 7).to(dtype)
