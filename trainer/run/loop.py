"""The training loop: one optimizer step per iteration, evaluation, log lines, checkpoints, graceful stop.

One iteration = ``num_microbatches`` micro-batches through ``trainer.parallel.train_step`` (1F1B or AFAB
across pipeline stages, gradients accumulated in fp32 and averaged over data-parallel ranks), then
unscale (fp16), global gradient norm and clipping, the overflow/NaN decision, the optimizer step and the
LR scheduler step (in samples). Every decision that ends or skips a step is taken from values that are
identical on all ranks (the loss and gradient norm are all-reduced; the stop flag is all-reduced at the
step boundary), so ranks never diverge in control flow.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from trainer.health import Monitor
from trainer.log import get_logger
from trainer.metrics_file import append_record
from trainer.optim.lr import OptimizerParamScheduler
from trainer.optim.precision import LossScaler
from trainer.parallel import ParallelModel, clip_grad_norm, eval_step, train_step
from trainer.parallel.grad_norm import unscale_main_grads_
from trainer.restore.state import TrainState
from trainer.run import metrics
from trainer.signals import EXIT_OK, EXIT_REQUEUE, StopRequest

log = get_logger(__name__)


class NonFiniteError(RuntimeError):
    """The loss or gradient norm became NaN/inf where no loss scaler can absorb it (fp32/bf16)."""


@dataclass
class StepOutcome:
    loss: float
    grad_norm: float
    applied: bool


@dataclass(frozen=True)
class Cadence:
    """When the loop logs, evaluates and saves (iterations; the ``train`` section's values)."""

    log_interval: int
    eval_interval: int | None  # None: no evaluation
    eval_iters: int
    save_interval: int | None  # None: save only on a stop and at the end


@dataclass(frozen=True)
class Throughput:
    """The constants of the throughput figures in each log line."""

    flops_per_iter: float  # Megatron's formula (trainer.formulas)
    tokens_per_iter: int
    world_size: int
    peak_tflops: float | None  # None: no MFU (CPU, unknown GPU)


@dataclass
class Loop:
    """Everything the loop touches (built by ``trainer.run.entry``). ``monitor`` (heartbeats and the hang
    watchdog) is told of every batch, step and save by the loop itself."""

    model: ParallelModel
    optimizer: torch.optim.Optimizer
    scheduler: OptimizerParamScheduler
    scaler: LossScaler
    precision: str
    clip_grad: float
    global_batch_size: int
    num_microbatches: int
    train_iters: int
    train_data: Iterator | None
    valid_data: Iterator | None
    save: Callable[[TrainState], None]
    wandb: metrics.WandbLogger
    cadence: Cadence
    throughput: Throughput
    metrics_file: str | None = None
    on_step: Callable[[int, float], None] | None = None
    monitor: Monitor | None = None
    kernel_fallbacks: tuple[str, ...] = ()  # named in every log line (trainer.ops.selfcheck)
    losses: dict[int, float] = field(default_factory=dict)
    eval_losses: dict[int, float] = field(default_factory=dict)


def step(loop: Loop, batches: list[dict]) -> StepOutcome:
    """One optimizer step over this rank's micro-batches."""
    model = loop.model
    model.loss_scale = loop.scaler.scale
    loss = train_step(model, batches).item()
    unscale_main_grads_(model, loop.scaler.scale)  # the distributed optimizer's are its shards
    norm = clip_grad_norm(model, loop.clip_grad)
    finite = math.isfinite(norm) and math.isfinite(loss)
    if loop.scaler.dynamic:
        loop.scaler.update(not finite)
    elif not finite:
        raise NonFiniteError(f"{'loss' if not math.isfinite(loss) else 'gradient norm'} is not finite "
                             f"(loss={loss}, grad norm={norm}) in {loop.precision}; the step was not applied")
    if finite:
        loop.optimizer.step()
    loop.scheduler.step(loop.global_batch_size)  # Megatron advances the schedule on skipped steps too
    return StepOutcome(loss, norm, finite)


def evaluate(loop: Loop, state: TrainState) -> float:
    """Mean validation loss over ``eval_iters`` global batches (the validation stream continues)."""
    total = 0.0
    for _ in range(loop.cadence.eval_iters):
        batches = next_batches(loop, loop.valid_data, "eval")
        total += eval_step(loop.model, batches).item()
        state.consumed_valid_samples += loop.global_batch_size
    return total / max(loop.cadence.eval_iters, 1)


def next_batches(loop: Loop, stream: Iterator | None, phase: str) -> list[dict]:
    """One step's micro-batches; each read is progress for the hang watchdog (the first training batch
    arms it: start-up, however slow, is not a hang)."""
    out = []
    for _ in range(loop.num_microbatches):
        if loop.monitor is not None:
            loop.monitor.tick(phase=phase, arm=phase == "train")
        out.append(next(stream))  # type: ignore[arg-type]
        if loop.monitor is not None:
            loop.monitor.tick()
    return out


def _save(loop: Loop, state: TrainState) -> None:
    """Save, with the monitor's phase saying so (a slow save is reported as one, not as a hang)."""
    previous = loop.monitor.phase if loop.monitor is not None else None
    if loop.monitor is not None:
        loop.monitor.tick(phase="save")
    loop.save(state)
    if loop.monitor is not None:
        loop.monitor.tick(phase=previous)


def _stop_agreed(stop: StopRequest, device: torch.device) -> bool:
    """All ranks stop together if any rank received a stop signal (one tiny all-reduce per step)."""
    flag = torch.tensor([1.0 if stop.requested else 0.0], device=device)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _log_interval(loop: Loop, state: TrainState, stats: metrics.IntervalStats) -> None:
    t = loop.throughput
    thr = metrics.throughput(stats, t.flops_per_iter, t.tokens_per_iter, t.world_size, t.peak_tflops,
                             metrics.peak_memory_gb(loop.model.pstate.device))
    report = metrics.StepReport(state.iteration, loop.train_iters, state.consumed_train_samples,
                                loop.optimizer.param_groups[0]["lr"], loop.global_batch_size,
                                loop.scaler.scale, loop.kernel_fallbacks)
    log.info(metrics.format_log_line(report, stats, thr))
    values = metrics.interval_metrics(report, stats, thr)
    loop.wandb.log(values, step=state.iteration)
    _append_metrics(loop, {"iteration": state.iteration, **values})


def _append_metrics(loop: Loop, row: dict) -> None:
    """``loop.metrics_file`` (``trainer.metrics_file``) on rank 0: what the log lines say, for status tools
    and plots (after a crash-restart, iterations replayed since the last checkpoint appear again; the
    reader keeps the last one)."""
    if loop.metrics_file is None or loop.model.pstate.rank != 0:
        return
    append_record(loop.metrics_file, row)


def _run_eval(loop: Loop, state: TrainState) -> None:
    loss = evaluate(loop, state)
    loop.eval_losses[state.iteration] = loss
    log.info("-" * 100)
    log.info(metrics.format_eval_line(state.iteration, loss))
    log.info("-" * 100)
    ppl = math.exp(min(20.0, loss))
    loop.wandb.log({"valid/lm_loss": loss, "valid/ppl": ppl}, step=state.iteration)
    _append_metrics(loop, {"iteration": state.iteration, "valid/lm_loss": loss, "valid/ppl": ppl})


def train(loop: Loop, state: TrainState, stop: StopRequest) -> int:
    """Iterate until ``train_iters`` or an agreed stop; returns the exit code (signals module)."""
    c = loop.cadence
    stats = metrics.IntervalStats(**state.log_window)
    while state.iteration < loop.train_iters:
        t0 = time.perf_counter()
        out = step(loop, next_batches(loop, loop.train_data, "train"))
        state.iteration += 1
        state.consumed_train_samples += loop.global_batch_size
        if not out.applied:
            state.skipped_iters += 1
            state.nan_iters += 0 if math.isfinite(out.loss) else 1
        stats.add(out.loss, out.applied, out.grad_norm if out.applied else None, time.perf_counter() - t0)
        loop.losses[state.iteration] = out.loss
        if loop.monitor is not None:
            loop.monitor.tick(state.iteration)
        if loop.on_step is not None:
            loop.on_step(state.iteration, out.loss)
        if state.iteration % c.log_interval == 0:
            _log_interval(loop, state, stats)
            stats = metrics.IntervalStats()
        if c.eval_interval and state.iteration % c.eval_interval == 0 and c.eval_iters:
            _run_eval(loop, state)
        stopping = _stop_agreed(stop, loop.model.pstate.device)
        periodic = c.save_interval and state.iteration % c.save_interval == 0
        if stopping or periodic or state.iteration == loop.train_iters:
            state.log_window = asdict(stats) if stats.iters else {}
            _save(loop, state)
        if stopping and state.iteration < loop.train_iters:
            why = stop.describe() if stop.requested else "signal on another rank"
            log.warning("stop requested (%s): checkpoint saved at iteration %d; exiting with code %d "
                        "(requeue to resume)", why, state.iteration, EXIT_REQUEUE)
            return EXIT_REQUEUE
    return EXIT_OK
