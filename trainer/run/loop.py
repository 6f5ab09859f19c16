"""The training loop: one optimizer step per iteration, evaluation, log lines, checkpoints, graceful stop.

One iteration = ``num_microbatches`` micro-batches through ``trainer.parallel.train_step`` (1F1B or AFAB
across pipeline stages, gradients accumulated in fp32 and averaged over data-parallel ranks), then
unscale (fp16), global gradient norm and clipping, the overflow/NaN decision, the optimizer step and the
LR scheduler step (in samples). Every decision that ends or skips a step is taken from values that are
identical on all ranks (the loss and gradient norm are all-reduced; the stop flag is all-reduced at the
step boundary), so ranks never diverge in control flow.

No host synchronisation on an iteration that does not log, evaluate, save or stop (trainer.run.host):
the loss and gradient norm stay on the device until the next such point and are read back together;
clipping is one multi-tensor multiply by min(1, max_norm / norm) computed on the device; the stop flag is
agreed on the host; the next step's batches are read, pinned and copied (non-blocking) while the device
runs this one. So in fp32/bf16 a NaN/inf loss or gradient norm is found at the next synchronisation point
(at most ``log_interval`` iterations later; never after a save, which is one): the run stops there,
naming the first bad iteration, with nothing saved past it. fp16 reads the overflow decision every step
(its loss scaler must skip the update on the host). A caller's ``on_step`` hook, which takes the loss as a
float, makes every iteration a synchronisation point (tests, profiling; ``trainer.run.main`` sets none).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch

from trainer.checkpoint.files import CheckpointError
from trainer.goodput import AttemptClock
from trainer.goodput.clock import CHECKPOINT, EVALUATION
from trainer.health import Monitor
from trainer.log import get_logger
from trainer.metrics_file import append_record
from trainer.optim.lr import OptimizerParamScheduler
from trainer.optim.precision import LossScaler
from trainer.parallel import ParallelModel, eval_step, train_step
from trainer.parallel.grad_norm import clip_by_global_norm, unscale_main_grads_
from trainer.restore.state import TrainState
from trainer.run import metrics
from trainer.run.host import Clock, Pending, StopAgreement, to_device
from trainer.signals import EXIT_OK, EXIT_REQUEUE, StopRequest

log = get_logger(__name__)


class NonFiniteError(RuntimeError):
    """The loss or gradient norm became NaN/inf where no loss scaler can absorb it (fp32/bf16)."""


@dataclass
class StepOutcome:
    """One step's loss and gradient norm as device scalars (``loss`` / ``grad_norm`` read them back: a
    host synchronisation each). ``applied``: fp16 decides on the host every step; fp32/bf16 always apply
    (a non-finite value stops the run at the next synchronisation point)."""

    loss_t: torch.Tensor
    norm_t: torch.Tensor
    applied: bool

    @property
    def loss(self) -> float:
        return float(self.loss_t)

    @property
    def grad_norm(self) -> float:
        return float(self.norm_t)


class BackgroundSaves(Protocol):
    """The loop's view of asynchronous saves: is the host copy of the one in flight still being made, wait
    for it before an update; has it failed; wait for all of it (raising)."""

    def copying(self) -> bool: ...

    def before_update(self) -> None: ...

    def failed(self) -> bool: ...

    def wait(self) -> float: ...


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
    save: Callable[..., None]  # save(state, final=False): trainer.run.saving.Saver
    wandb: metrics.WandbLogger
    cadence: Cadence
    throughput: Throughput
    metrics_file: str | None = None
    on_step: Callable[[int, float], None] | None = None
    monitor: Monitor | None = None
    kernel_fallbacks: tuple[str, ...] = ()  # named in every log line (trainer.ops.selfcheck)
    stop_group: object = None  # where the ranks agree on a stop (trainer.run.host.host_group)
    clock: AttemptClock | None = None  # where the attempt's time goes (trainer.goodput)
    background: BackgroundSaves | None = None  # the saves in flight (trainer.run.saving.Saver)
    losses: dict[int, float] = field(default_factory=dict)
    eval_losses: dict[int, float] = field(default_factory=dict)


def step(loop: Loop, batches: list[dict]) -> StepOutcome:
    """One optimizer step over this rank's micro-batches, queued on the device without reading anything
    back (except fp16's overflow decision)."""
    model = loop.model
    model.loss_scale = loop.scaler.scale
    loss = train_step(model, batches)
    unscale_main_grads_(model, loop.scaler.scale)  # the distributed optimizer's are its shards
    norm = clip_by_global_norm(model, loop.clip_grad)
    _before_update(loop)
    applied = True
    if loop.scaler.dynamic:  # fp16: skip the update on overflow, decided now (one read per step)
        applied = bool(torch.isfinite(norm) & torch.isfinite(loss))
        loop.scaler.update(not applied)
    if applied:
        loop.optimizer.step()
    loop.scheduler.step(loop.global_batch_size)  # Megatron advances the schedule on skipped steps too
    return StepOutcome(loss, norm, applied)


def _before_update(loop: Loop) -> None:
    """The forward and backward ran beside the host copy of a save in flight; the update changes what it
    copies, so it waits for the copy here (checkpoint time, not training time)."""
    if loop.background is None or not loop.background.copying():
        return
    span = loop.clock.switch(CHECKPOINT) if loop.clock is not None else None
    loop.background.before_update()
    if loop.clock is not None:
        loop.clock.switch(span)


def evaluate(loop: Loop, state: TrainState) -> float:
    """Mean validation loss over ``eval_iters`` global batches (the validation stream continues)."""
    total = torch.zeros((), dtype=torch.float32, device=loop.model.pstate.device)
    for _ in range(loop.cadence.eval_iters):
        batches = next_batches(loop, loop.valid_data, "eval")
        total += eval_step(loop.model, batches).float()
        state.consumed_valid_samples += loop.global_batch_size
    return float(total) / max(loop.cadence.eval_iters, 1)  # one read for the whole evaluation


def next_batches(loop: Loop, stream: Iterator | None, phase: str) -> list[dict]:
    """One step's micro-batches; each read is progress for the hang watchdog (the first training batch
    arms it: start-up, however slow, is not a hang)."""
    out = []
    for _ in range(loop.num_microbatches):
        if loop.monitor is not None:
            loop.monitor.tick(phase=phase, arm=phase == "train")
        out.append(to_device(next(stream), loop.model.pstate.device))  # type: ignore[arg-type]
        if loop.monitor is not None:
            loop.monitor.tick()
    return out


def _save(loop: Loop, state: TrainState, final: bool) -> None:
    """Save (``final``: synchronously, the run waits for it anyway), with the monitor's phase saying so (a
    slow save is reported as one, not as a hang) and the clock counting the time training is blocked."""
    previous = loop.monitor.phase if loop.monitor is not None else None
    if loop.monitor is not None:
        loop.monitor.tick(phase="save")
    span = loop.clock.switch(CHECKPOINT) if loop.clock is not None else None
    loop.save(state, final=final)
    if loop.clock is not None:
        loop.clock.switch(span)
    if loop.monitor is not None:
        loop.monitor.tick(phase=previous)


def _raise_failed_save(loop: Loop, state: TrainState) -> None:
    """A background save failed on some rank (agreed at this step): every rank raises its error now."""
    if loop.background is not None:
        loop.background.wait()  # raises the failed save's error
    raise CheckpointError(f"a background checkpoint failed on another rank (found at iteration "
                          f"{state.iteration}); the latest checkpoint is unchanged")


def _log_interval(loop: Loop, state: TrainState, stats: metrics.IntervalStats) -> None:
    t = loop.throughput
    thr = metrics.throughput(stats, t.flops_per_iter, t.tokens_per_iter, t.world_size, t.peak_tflops,
                             metrics.peak_memory_gb(loop.model.pstate.device))
    report = metrics.StepReport(state.iteration, loop.train_iters, state.consumed_train_samples,
                                loop.optimizer.param_groups[0]["lr"], loop.global_batch_size,
                                loop.scaler.scale, loop.kernel_fallbacks)
    log.info(metrics.format_log_line(report, stats, thr))
    values = metrics.interval_metrics(report, stats, thr)
    loop.wandb.log({**values, **(loop.clock.run_values() if loop.clock is not None else {})},
                   step=state.iteration)
    if loop.clock is not None:  # rank 0's record (no-op elsewhere): how far this attempt got
        loop.clock.write()
    _append_metrics(loop, {"iteration": state.iteration, **values})


def _append_metrics(loop: Loop, row: dict) -> None:
    """``loop.metrics_file`` (``trainer.metrics_file``) on rank 0: what the log lines say, for status tools
    and plots (after a crash-restart, iterations replayed since the last checkpoint appear again; the
    reader keeps the last one)."""
    if loop.metrics_file is None or loop.model.pstate.rank != 0:
        return
    append_record(loop.metrics_file, row)


def _run_eval(loop: Loop, state: TrainState) -> None:
    previous = loop.monitor.phase if loop.monitor is not None else None
    span = loop.clock.switch(EVALUATION) if loop.clock is not None else None
    loss = evaluate(loop, state)
    if loop.clock is not None:
        loop.clock.switch(span)
    if loop.monitor is not None:  # the next training batches may already be read (prefetched)
        loop.monitor.tick(phase=previous)
    loop.eval_losses[state.iteration] = loss
    log.info("-" * 100)
    log.info(metrics.format_eval_line(state.iteration, loss))
    log.info("-" * 100)
    ppl = math.exp(min(20.0, loss))
    loop.wandb.log({"valid/lm_loss": loss, "valid/ppl": ppl}, step=state.iteration)
    _append_metrics(loop, {"iteration": state.iteration, "valid/lm_loss": loss, "valid/ppl": ppl})


def _read_back(loop: Loop, state: TrainState, stats: metrics.IntervalStats, pending: Pending,
               clock: Clock) -> None:
    """A synchronisation point: the pending iterations' losses and norms come back in one transfer, each
    counted as before; the interval's wall time is shared among them. A non-finite value in fp32/bf16
    stops the run (NonFiniteError) with ``state.iteration`` at the last good iteration."""
    if not len(pending):
        return
    rows = pending.take()
    seconds = clock.lap() / len(rows)
    for iteration, loss, norm, applied in rows:
        finite = math.isfinite(loss) and math.isfinite(norm)
        if applied and not finite:  # fp32/bf16 (fp16's overflow steps were not applied)
            state.iteration = iteration - 1
            found = state.iteration + len(rows)
            raise NonFiniteError(
                f"{'loss' if not math.isfinite(loss) else 'gradient norm'} is not finite at iteration "
                f"{iteration} (loss={loss}, grad norm={norm}) in {loop.precision}; found at iteration "
                f"{found}, the next synchronisation point")
        if not applied:
            state.skipped_iters += 1
            state.nan_iters += 0 if math.isfinite(loss) else 1
        stats.add(loss, applied, norm if applied else None, seconds)
        loop.losses[iteration] = loss
        if loop.on_step is not None:
            loop.on_step(iteration, loss)


def train(loop: Loop, state: TrainState, stop: StopRequest) -> int:
    """Iterate until ``train_iters`` or an agreed stop; returns the exit code (signals module). A failed
    background save raises its error here, on every rank at the same step."""
    c = loop.cadence
    stats = metrics.IntervalStats(**state.log_window)
    pending, clock = Pending(), Clock(loop.model.pstate.device)
    agree = StopAgreement(loop.stop_group)
    if loop.clock is not None:
        loop.clock.training(state.iteration)
    batches = next_batches(loop, loop.train_data, "train") if state.iteration < loop.train_iters else []
    while state.iteration < loop.train_iters:
        out = step(loop, batches)
        state.iteration += 1
        state.consumed_train_samples += loop.global_batch_size
        pending.add(state.iteration, out.loss_t, out.norm_t, out.applied)
        if state.iteration < loop.train_iters:  # read while the device runs this step
            batches = next_batches(loop, loop.train_data, "train")
        if loop.monitor is not None:
            loop.monitor.tick(state.iteration)
        logs = state.iteration % c.log_interval == 0
        evals = bool(c.eval_interval and state.iteration % c.eval_interval == 0 and c.eval_iters)
        if logs or evals or loop.on_step is not None:
            _read_back(loop, state, stats, pending, clock)
        if loop.clock is not None:
            loop.clock.step(state.iteration)
        if logs:
            _log_interval(loop, state, stats)
            stats = metrics.IntervalStats()
        if evals:
            _run_eval(loop, state)
        stopping = agree(stop.requested, loop.background is not None and loop.background.failed())
        if agree.save_failed:
            _raise_failed_save(loop, state)
        periodic = c.save_interval and state.iteration % c.save_interval == 0
        final = bool(stopping) or state.iteration == loop.train_iters
        if final or periodic:
            _read_back(loop, state, stats, pending, clock)  # nothing non-finite is ever saved
            state.log_window = asdict(stats) if stats.iters else {}
            _save(loop, state, final)
        if evals or stopping or periodic:
            clock.restart()  # evaluation and saving are not training time
        if stopping and state.iteration < loop.train_iters:
            why = stop.describe() if stop.requested else "signal on another rank"
            log.warning("stop requested (%s): checkpoint saved at iteration %d; exiting with code %d "
                        "(requeue to resume)", why, state.iteration, EXIT_REQUEUE)
            return EXIT_REQUEUE
    return EXIT_OK
