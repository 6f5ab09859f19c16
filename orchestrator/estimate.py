"""Per-device memory and run-time estimates (pure arithmetic on the typed config).

Memory follows Megatron's accounting: mixed precision keeps 16-bit weights, fp32 main gradients, an fp32
master copy and two fp32 Adam moments (2 + 4 + 4 + 8 = 18 bytes per parameter); fp32 training keeps 4 + 4
+ 8 = 16. Activations per transformer layer follow Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", table 2; :func:`trainer.formulas.stage_activation_bytes`,
which follows train.recompute_*): s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes with tensor parallelism t,
s·b·h·(34 + 5·a·s/h)/t with sequence parallelism, without the attention term with selective
recomputation, 2·s·b·h (/t with SP) per recomputed layer input with full recomputation; 1F1B keeps up to
p micro-batches in flight on the first stage, so that stage holds the activations of L layers in total.
Run time uses Megatron's FLOPs formula (performance.md), the trainer's own definition
(:func:`trainer.formulas.flops_per_iteration`, padded vocabulary), so the ETA and the trainer's logged
TFLOP/s count the same work.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.layout import Layout
from orchestrator.schema import SlipwayConfig
from trainer import formulas

GIB = 1024**3


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on the most loaded device (the first pipeline stage)."""

    params: int  # parameter count on that device
    weights_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    logits_bytes: int
    reserved_bytes: int
    device_bytes: int  # 0: unknown

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
    def fits(self) -> bool:
        return self.device_bytes == 0 or self.total_bytes <= self.device_bytes


def stage_params(cfg: SlipwayConfig, vocab: int) -> tuple[int, int]:
    """(parameters on the first stage's device, parameters of the whole model)."""
    m, p = cfg.model, cfg.parallel
    h, tp, pp = m.hidden_size, max(p.tp_size, 1), max(p.pp_size, 1)
    per_layer = 12 * h * h + 13 * h  # QKV, dense, two MLP matrices, their biases, two layer norms
    v = formulas.padded_vocab_size(vocab, tp, m.make_vocab_size_divisible_by)
    embed = v * h + m.max_position_embeddings * h
    total = m.num_layers * per_layer + embed + 2 * h
    first = (m.num_layers // pp) * per_layer // tp + v * h // tp + m.max_position_embeddings * h
    if pp == 1:
        first += 2 * h  # final layer norm lives on the last stage
    return first, total


def estimate_memory(cfg: SlipwayConfig, vocab: int, lay: Layout) -> MemoryEstimate:
    m, t, p = cfg.model, cfg.train, cfg.parallel
    params, _ = stage_params(cfg, vocab)
    half = t.precision in ("fp16", "bf16")
    w_bytes, g_bytes, o_bytes = (2, 4, 12) if half else (4, 4, 8)
    act_el = 1 if half else 2  # the formula counts 16-bit activations; fp32 doubles them
    tp, pp = max(p.tp_size, 1), max(p.pp_size, 1)
    in_flight = min(pp, lay.num_microbatches or pp)
    per_microbatch = formulas.stage_activation_bytes(
        m.num_layers // pp, m.seq_length, t.micro_batch_size, m.hidden_size, m.num_attention_heads, tp,
        p.sequence_parallel, t.recompute_granularity, t.recompute_method, t.recompute_num_layers)
    # fp32 logits for the vocab-parallel cross-entropy (last stage; counted on the same device when pp=1).
    v = formulas.padded_vocab_size(vocab, tp, m.make_vocab_size_divisible_by)
    logits = 4 * m.seq_length * t.micro_batch_size * v // tp if pp == 1 else 0
    return MemoryEstimate(
        params=params,
        weights_bytes=params * w_bytes,
        grads_bytes=params * g_bytes,
        optimizer_bytes=params * o_bytes,
        activations_bytes=int(per_microbatch * in_flight * act_el),
        logits_bytes=logits,
        reserved_bytes=int(cfg.cluster.reserved_memory_gb * GIB),
        device_bytes=int(cfg.cluster.device_memory_gb * GIB),
    )


@dataclass(frozen=True)
class TimeEstimate:
    flops_per_iter: float
    step_s: float
    bubble_fraction: float
    eta_s: float
    device_hours: float
    first_checkpoint_s: float


def estimate_time(cfg: SlipwayConfig, vocab: int, lay: Layout) -> TimeEstimate:
    c = cfg.cluster
    m = cfg.model
    # The padded vocabulary: the logit matmul runs over every embedding row, as the trainer counts it.
    v = formulas.padded_vocab_size(vocab, max(cfg.parallel.tp_size, 1), m.make_vocab_size_divisible_by)
    flops = formulas.flops_per_iteration(lay.global_batch, m.seq_length, m.num_layers, m.hidden_size, v)
    rate = max(lay.world, 1) * c.device_peak_tflops * 1e12 * max(c.mfu, 1e-6)
    mb = max(lay.num_microbatches, 1)
    bubble = (lay.pp - 1) / (mb + lay.pp - 1) if lay.pp > 1 else 0.0
    step = flops / rate / (1 - bubble)
    eta = step * cfg.train.iters
    return TimeEstimate(
        flops,
        step,
        bubble,
        eta,
        eta / 3600 * max(lay.world, 1),
        step * min(cfg.train.save_interval or cfg.train.iters, cfg.train.iters),
    )


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
    rows.append((f"device ({device_name})", cap, "fits" if mem.fits else "DOES NOT FIT"))
    return "\n".join(f"  {a:<26}{b:>14}  {c}".rstrip() for a, b, c in rows)
