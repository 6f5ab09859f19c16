"""Device memory: the plan's per-device estimate (orchestrator/base/estimate.py) against the device, with the
options that would lower it (plan.MEMORY_OPTIONS, each at the plan's own figure) in the fix."""

from __future__ import annotations

from orchestrator.base.estimate import GIB, MemoryEstimate, MemoryOption
from orchestrator.base.plan_types import Context
from orchestrator.base.problems import Problem


def _memory_advice(mem: MemoryEstimate, options: list[MemoryOption]) -> str:
    """The options that would lower ``mem``, each with its total."""
    options = [f"{o.name} → {o.memory.total_bytes / GIB:.1f} GiB "
               f"({'fits' if o.memory.fits else 'still too much'})" for o in options
               if o.memory.total_bytes < mem.total_bytes]
    return "; ".join(options)


def memory_problems(ctx: Context) -> list[Problem]:
    if ctx.estimates is None or ctx.estimates.memory.fits:  # no estimate: the layout checks say why
        return []
    cfg, mem = ctx.cfg, ctx.estimates.memory
    hint = "raise parallel.tp_size/pp_size or lower train.micro_batch_size"
    options = _memory_advice(mem, ctx.estimates.memory_options)
    if options:
        hint += f", or (same math, the plan's figure for each): {options}"
    acts = mem.total_bytes - mem.weights_bytes - mem.grads_bytes - mem.optimizer_bytes
    parts = (
        f"weights {mem.weights_bytes / GIB:.1f} + grads {mem.grads_bytes / GIB:.1f} + optimizer "
        f"{mem.optimizer_bytes / GIB:.1f} + activations/logits/reserved {acts / GIB:.1f}"
    )
    return [
        Problem(
            "memory",
            "train.micro_batch_size",
            cfg.train.micro_batch_size,
            f"needs {mem.total_bytes / GIB:.1f} GiB per device ({parts}) but {cfg.cluster.device_name} has "
            f"{mem.device_bytes / GIB:.0f} GiB, {mem.limit_bytes / GIB:.1f} of them for the estimate "
            f"(cluster.memory_headroom={mem.headroom:g} keeps that share of the usable memory free)"
            f"{_needs(ctx)}",
            hint,
        )
    ]


def _needs(ctx: Context) -> str:
    """How many GPUs one model replica needs, when no memory option makes the layout fit."""
    est = ctx.estimates
    if est is None or any(o.memory.fits for o in est.memory_options):
        return ""
    if est.smallest_replica is None:
        return ("; no tensor × pipeline split of this model fits one replica on these devices at "
                f"micro-batch {ctx.cfg.train.micro_batch_size}, even with every memory saver")
    tp, pp = est.smallest_replica
    return (f"; with every memory saver one model replica fits on {tp * pp} GPUs (parallel.tp_size={tp} "
            f"parallel.pp_size={pp}: the fewest, before any sharding over data-parallel ranks), so "
            f"cluster.gpus a multiple of {tp * pp}")
