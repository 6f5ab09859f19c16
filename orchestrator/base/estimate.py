"""Per-device memory and run-time estimates (pure arithmetic on the typed config).

Memory: weights, gradients and optimizer state per parameter are
:func:`trainer.memory_formulas.state_bytes_per_param` (Slipway's autocast layout keeps 4 + 4 + 8 = 16 bytes
in every precision; ``optim.distributed`` gives Megatron's 4 + 4 + 8/d in fp32 and 2 + 4 + 12/d in
bf16/fp16). Activations per transformer layer follow Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", table 2; :func:`trainer.memory_formulas.stage_activation_bytes`,
which follows train.recompute_*) with the coefficients of the run's kernels
(:func:`trainer.memory_formulas.activation_profile`: measured on CPU, the paper's on GPU, where flash SDPA
keeps no s×s scores); 1F1B keeps up to p micro-batches in flight on the first stage, so that stage holds
the activations of L layers in total, times ``1 + (p − 1)/(p·v)`` when interleaved.
Run time uses Megatron's FLOPs formula (performance.md), the trainer's own definition
(:func:`trainer.formulas.flops_per_iteration`, padded vocabulary), so the ETA and the trainer's logged
TFLOP/s count the same work; recomputation adds its forward FLOPs
(:func:`trainer.time_formulas.recompute_time_factor`), at the device's peak and MFU
(orchestrator/base/hardware.py: the site file, the device table, the figure measured in bench/) scaled to
the run's micro-batch by the measured efficiency curve (:func:`mfu_of`: a micro-batch's matrix products,
tokens × hidden² / tp, run at ``x/(x + half)`` of the saturated speed); tensor
parallelism adds its all-reduces at the node's bus bandwidth (:func:`tensor_parallel_seconds`); the
pipeline stretches both by its bubble, ``(p − 1)/(v·m)`` of the ideal time for 1F1B
(:func:`trainer.time_formulas.bubble_fraction`); the data-parallel exchange adds what backward does not
hide (:func:`exchange_seconds`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from orchestrator.base.hardware import hardware
from orchestrator.base.layout import Layout
from orchestrator.base.schema import SlipwayConfig
from trainer import formulas, memory_formulas, time_formulas
from trainer.config.train import PRECISION_FACTS, precision_recipe

GIB = 1024**3
DEVICE_HOURS = "device-hours"
"""The unit of a run's cost, everywhere it is printed: devices (GPUs; CPU tasks on a cluster without GPUs)
× hours of the ETA (TimeEstimate.device_hours)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on the most loaded device (the busiest pipeline stage)."""

    params: int  # parameter count on that device
    weights_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    logits_bytes: int
    reserved_bytes: int
    device_bytes: int  # 0: unknown
    headroom: float = 0.0  # cluster.memory_headroom: the share of the usable memory kept free

    @property
    def total_bytes(self) -> int:
        return (
            self.weights_bytes
            + self.grads_bytes
            + self.optimizer_bytes
            + self.activations_bytes
            + self.logits_bytes
            + self.reserved_bytes
        )

    @property
    def limit_bytes(self) -> int:
        """The most the estimate may reach: the reserved bytes plus (1 − headroom) of the rest of the
        device (the one headroom rule: the memory check, the options and layout=auto's search)."""
        usable = max(self.device_bytes - self.reserved_bytes, 0)
        return self.reserved_bytes + int(usable * (1 - self.headroom))

    @property
    def fits(self) -> bool:
        return self.device_bytes == 0 or self.total_bytes <= self.limit_bytes


NO_MEMORY = MemoryEstimate(0, 0, 0, 0, 0, 0, 0, 0)  # no estimate: the model's sizes are broken (PROBLEMS)


def stage_params(cfg: SlipwayConfig, vocab: int) -> tuple[int, int]:
    """(parameters on the busiest stage's device, parameters of the whole model):
    :func:`trainer.formulas.stage_params` for this run's model, padded vocabulary and layout."""
    m, p = cfg.model, cfg.parallel
    tp, pp = max(p.tp_size, 1), max(p.pp_size, 1)
    padded = formulas.padded_vocab_size(vocab, tp, m.make_vocab_size_divisible_by)
    return formulas.stage_params(m, padded, tp, pp, stage_layers(cfg))


def stage_layers(cfg: SlipwayConfig) -> list[int]:
    """Layers on each pipeline stage (ParallelConfig.split: even, or Megatron's uneven split); a split
    that cannot be counts num_layers // pp each (its own problem is reported: pp_layers)."""
    m, pp = cfg.model, max(cfg.parallel.pp_size, 1)
    split = cfg.parallel.split(m.num_layers, 1)
    return [m.num_layers // pp] * pp if split.problem() else split.stage_counts()


def activation_profile(cfg: SlipwayConfig) -> memory_formulas.ActivationProfile:
    """The measured (CPU) or published (GPU) activation coefficients for this run's kernels."""
    device = "cuda" if cfg.cluster.gpus_per_node else "cpu"
    m = cfg.model
    profile = memory_formulas.activation_profile(device, cfg.kernels, m.attention_backend,
                                                 cfg.train.precision)
    return profile.for_architecture(m)


def sharded_masters(cfg: SlipwayConfig) -> bool:
    """Whether the run keeps the distributed optimizer's layout (16-bit parameters, fp32 masters and moments
    sharded over dp): ``optim.distributed``, or the ``master_weights`` precision recipe, which uses that
    layout at any dp (trainer/config/train.py)."""
    t = cfg.train
    recipe = precision_recipe(t.precision, t.precision_recipe, cfg.optim.distributed)
    return cfg.optim.distributed or recipe == "master_weights"


def estimate_memory(cfg: SlipwayConfig, vocab: int, lay: Layout) -> MemoryEstimate:
    m, t, p = cfg.model, cfg.train, cfg.parallel
    params, _ = stage_params(cfg, vocab)
    w_bytes, g_bytes, o_bytes = memory_formulas.state_bytes_per_param(t.precision, sharded_masters(cfg),
                                                               max(lay.dp, 1))
    tp, pp = max(p.tp_size, 1), max(p.pp_size, 1)
    # 1F1B: stage r keeps up to p − r micro-batches in flight; with an uneven split the busiest stage is
    # the one whose layers × micro-batches is largest.
    in_flight, layers = max(((min(pp - r, lay.num_microbatches or pp), n)
                             for r, n in enumerate(stage_layers(cfg))), key=lambda f: f[0] * f[1])
    per_microbatch = memory_formulas.stage_activation_bytes(
        layers, m.seq_length, t.micro_batch_size, m.hidden_size, m.num_attention_heads, tp,
        p.sequence_parallel, t.recompute_granularity, t.recompute_method, t.recompute_num_layers,
        activation_profile(cfg))
    interleave = memory_formulas.interleaved_memory_factor(pp, p.virtual_pp_size)
    # fp32 logits for the vocab-parallel cross-entropy (last stage; counted on the same device when pp=1).
    v = formulas.padded_vocab_size(vocab, tp, m.make_vocab_size_divisible_by)
    logits = 4 * m.seq_length * t.micro_batch_size * v // tp if pp == 1 else 0
    return MemoryEstimate(
        params=params,
        weights_bytes=int(params * w_bytes),
        grads_bytes=int(params * g_bytes),
        optimizer_bytes=int(params * o_bytes),
        activations_bytes=int(per_microbatch * in_flight * interleave),
        logits_bytes=logits,
        reserved_bytes=int(cfg.cluster.reserved_memory_gb * GIB),
        device_bytes=int(hardware(cfg).memory_gb.value * GIB),
        headroom=cfg.cluster.memory_headroom,
    )


@dataclass(frozen=True)
class TimeEstimate:
    flops_per_iter: float
    step_s: float  # NaN when the device's peak is unknown (a plan problem says so)
    bubble_fraction: float
    eta_s: float
    device_hours: float
    first_checkpoint_s: float
    exchange_s: float = 0.0  # the data-parallel gradient (and weight) exchange of one step, in all
    exposed_s: float = 0.0  # the part of it not hidden behind the last micro-batch's backward
    tp_comm_s: float = 0.0  # the tensor-parallel all-reduces of one step (every micro-batch's), not hidden
    p2p_s: float = 0.0  # the pipeline's stage-to-stage transfers of one step, not hidden
    mfu: float = math.nan  # the MFU the compute ran at: the figure at this run's micro-batch (mfu_of)

    @property
    def known(self) -> bool:
        return math.isfinite(self.step_s)


NO_TIME = TimeEstimate(math.nan, math.nan, 0.0, math.nan, math.nan, math.nan)  # see NO_MEMORY


def element_bytes(precision: str) -> int:
    """Bytes of an activation in the compute dtype: what the tensor- and pipeline-parallel traffic moves."""
    return PRECISION_FACTS[precision].element_bytes if precision in PRECISION_FACTS else 2


def exchange_gbps(cfg: SlipwayConfig, lay: Layout) -> float:
    """The bus bandwidth of the data-parallel exchange: the node's own where every data-parallel group lies
    in one node (a group spans tp × dp consecutive ranks, tp fastest: trainer/parallel/state.py), else
    ``cluster.bus_bandwidth_gbps``."""
    if lay.nodes <= 1 or lay.tasks_per_node % max(lay.tp * lay.dp, 1) == 0:
        return hardware(cfg).intra_node_gbps.value
    return cfg.cluster.bus_bandwidth_gbps


def pipeline_gbps(cfg: SlipwayConfig, lay: Layout) -> float:
    """The bandwidth of the pipeline's slowest stage-to-stage link: the network when the run spans nodes
    (stages follow one another across the ranks, so some boundary crosses a node), else the node's own."""
    return cfg.cluster.bus_bandwidth_gbps if lay.nodes > 1 else hardware(cfg).intra_node_gbps.value


def exchange_seconds(cfg: SlipwayConfig, params: int, lay: Layout) -> tuple[float, float]:
    """(the data-parallel exchange of one step, the part of it hidden behind backward at most).

    Gradients (fp32 buckets, :func:`trainer.memory_formulas.state_bytes_per_param`) are all-reduced over dp,
    or with ``optim.distributed`` reduce-scattered and the updated weights all-gathered after the step
    (:func:`trainer.time_formulas.collective_seconds`, at :func:`exchange_gbps`). With
    ``parallel.overlap_grad_reduce`` the gradient buckets go while the last micro-batch's backward still
    runs (about 2/3 of its compute); the weights' all-gather waits for the optimizer step."""
    t, dp, bus = cfg.train, max(lay.dp, 1), exchange_gbps(cfg, lay)
    w_bytes, g_bytes, _ = memory_formulas.state_bytes_per_param(t.precision, sharded_masters(cfg), dp)
    if sharded_masters(cfg):
        grads = time_formulas.collective_seconds("reduce_scatter", params * g_bytes, dp, bus)
        weights = time_formulas.collective_seconds("all_gather", params * w_bytes, dp, bus)
    else:
        grads = time_formulas.collective_seconds("all_reduce", params * g_bytes, dp, bus)
        weights = 0.0
    return grads + weights, grads if cfg.parallel.overlap_grad_reduce else 0.0


def tensor_parallel_seconds(cfg: SlipwayConfig, lay: Layout) -> float:
    """The tensor-parallel all-reduces of one step on the busiest stage's devices
    (:func:`trainer.time_formulas.tensor_parallel_seconds` for each of its micro-batches), at the bus
    bandwidth between the GPUs of a node (a tensor-parallel group stays within one:
    Hardware.intra_node_gbps)."""
    t, m, tp = cfg.train, cfg.model, max(lay.tp, 1)
    if tp < 2:
        return 0.0
    layers = max(stage_layers(cfg))
    if t.recompute_granularity != "full":
        recomputed = 0
    elif t.recompute_method == "uniform":
        recomputed = layers
    else:
        recomputed = min(t.recompute_num_layers, layers)
    per_microbatch = time_formulas.tensor_parallel_seconds(
        layers, t.micro_batch_size, m.seq_length, m.hidden_size, tp, element_bytes(t.precision),
        hardware(cfg).intra_node_gbps.value, recomputed)
    return per_microbatch * max(lay.num_microbatches, 1)


def pipeline_seconds(cfg: SlipwayConfig, lay: Layout) -> float:
    """The pipeline's point-to-point traffic of one step (:func:`trainer.time_formulas.pipeline_p2p_seconds`)
    at :func:`pipeline_gbps`."""
    if lay.pp < 2:
        return 0.0
    t, m = cfg.train, cfg.model
    return time_formulas.pipeline_p2p_seconds(max(lay.num_microbatches, 1), t.micro_batch_size, m.seq_length,
                                         m.hidden_size, element_bytes(t.precision), pipeline_gbps(cfg, lay))


def mfu_of(cfg: SlipwayConfig, lay: Layout) -> float:
    """The MFU of this run's micro-batch: the hardware's figure scaled by its efficiency curve
    (Hardware.mfu_at) to the size of one micro-batch's matrix products on one device, which tensor
    parallelism splits (:func:`trainer.time_formulas.gemm_size`)."""
    m = cfg.model
    size = time_formulas.gemm_size(cfg.train.micro_batch_size, m.seq_length, m.hidden_size, max(lay.tp, 1))
    return hardware(cfg).mfu_at(size)


def stage_balance(cfg: SlipwayConfig, padded_vocab: int) -> float:
    """How much longer than an evenly loaded pipeline a step takes: pp × the busiest stage's share of the
    FLOPs (its layers, and on the last stage the logits), 1 without a pipeline. The slowest stage paces
    every micro-batch (Megatron's uneven split and its loss-layer accounting exist for this)."""
    m, counts = cfg.model, stage_layers(cfg)
    if len(counts) < 2:
        return 1.0
    body = formulas.model_flops_per_iteration(m, 1, 0)  # every layer, no logits
    head = formulas.model_flops_per_iteration(m, 1, padded_vocab) - body
    stages = [n * body / m.num_layers for n in counts]
    stages[-1] += head
    return len(counts) * max(stages) / (body + head)


def estimate_time(cfg: SlipwayConfig, vocab: int, lay: Layout) -> TimeEstimate:
    hw, m = hardware(cfg), cfg.model
    # The padded vocabulary: the logit matmul runs over every embedding row, as the trainer counts it.
    v = formulas.padded_vocab_size(vocab, max(cfg.parallel.tp_size, 1), m.make_vocab_size_divisible_by)
    flops = formulas.model_flops_per_iteration(m, lay.global_batch, v)
    peak = hw.peak_tflops.value if hw.peak_tflops.value else math.nan
    mfu = mfu_of(cfg, lay)
    rate = max(lay.world, 1) * peak * 1e12 * max(mfu, 1e-6)
    mb = max(lay.num_microbatches, 1)
    # The step takes (1 + bubble) times the ideal compute (performance.md), interleaving included.
    bubble = time_formulas.bubble_fraction(lay.pp, mb, cfg.parallel.virtual_pp_size)
    t, layers = cfg.train, max(stage_layers(cfg))  # the slowest stage sets the pace
    recompute = time_formulas.recompute_time_factor(t.recompute_granularity, m.seq_length, m.hidden_size,
                                                    layers, t.recompute_method, t.recompute_num_layers)
    compute = flops * recompute * stage_balance(cfg, v) / rate
    # The all-reduces and the stage-to-stage transfers sit inside every micro-batch's forward and backward:
    # the bubble stretches them as it does the compute.
    tp_comm, p2p = tensor_parallel_seconds(cfg, lay), pipeline_seconds(cfg, lay)
    exchange, hideable = exchange_seconds(cfg, stage_params(cfg, vocab)[0], lay)
    exposed = exchange - min(hideable, compute * 2 / 3 / mb)  # the last micro-batch's backward
    step = (compute + tp_comm + p2p) * (1 + bubble) + exposed
    eta = step * t.iters
    return TimeEstimate(flops, step, bubble, eta, eta / 3600 * max(lay.world, 1),
                        step * min(t.save_interval or t.iters, t.iters), exchange, exposed, tp_comm, p2p, mfu)


def fmt_bytes(n: float) -> str:
    return f"{n / GIB:8.2f} GiB" if n >= GIB / 10 else f"{n / 1024**2:8.2f} MiB"


def fmt_duration(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    if s < 3 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} days"


def memory_table(mem: MemoryEstimate, device_name: str) -> str:
    rows = [
        ("parameters", f"{mem.params / 1e6:10.2f} M", ""),
        ("weights", fmt_bytes(mem.weights_bytes), ""),
        ("gradients", fmt_bytes(mem.grads_bytes), ""),
        ("optimizer state", fmt_bytes(mem.optimizer_bytes), ""),
        ("activations", fmt_bytes(mem.activations_bytes), ""),
        ("logits (fp32)", fmt_bytes(mem.logits_bytes), ""),
        ("reserved", fmt_bytes(mem.reserved_bytes), ""),
        ("total", fmt_bytes(mem.total_bytes), ""),
    ]
    cap = fmt_bytes(mem.device_bytes) if mem.device_bytes else "   unknown"
    if mem.device_bytes:
        rows.append((f"device ({device_name})", cap, ""))
        rows.append((f"limit ({mem.headroom:.0%} headroom)", fmt_bytes(mem.limit_bytes),
                     "fits" if mem.fits else "DOES NOT FIT"))
    else:
        rows.append((f"device ({device_name})", cap, "fits"))
    return "\n".join(f"  {a:<26}{b:>14}  {c}".rstrip() for a, b, c in rows)


@dataclass(frozen=True)
class MemoryOption:
    """One way to lower the memory (orchestrator.planning.plan.MEMORY_OPTIONS) and what it would give."""

    name: str  # the override, e.g. optim.distributed=true
    memory: MemoryEstimate
    step_ratio: float  # its step time over the configured one


def options_table(mem: MemoryEstimate, options: list[MemoryOption]) -> list[str]:
    """The dry run's "what each memory option would give" lines (plan.memory_options), beside the
    configured total: same math, different memory (and for recomputation, more time)."""
    if not options:
        return []
    lines = ["  with (same math; per-device total, change, step time):"]
    for o in options:
        delta = (o.memory.total_bytes - mem.total_bytes) / GIB
        fits = "" if o.memory.fits else "  does not fit"
        lines.append(f"    {o.name:<40}{fmt_bytes(o.memory.total_bytes)}  {delta:+7.2f} GiB  "
                     f"×{o.step_ratio:.2f}{fits}")
    return lines
