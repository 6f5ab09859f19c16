"""``trainer.run.run(cfg)``: data + model + parallelism + optimizer → a training run that survives restarts.

Standalone::

    python -m trainer.run --config resolved.yaml [section.key=value ...]
    torchrun --nproc-per-node N -m trainer.run --config resolved.yaml
    srun --ntasks-per-node=GPUS python -m trainer.run --config resolved.yaml   # one task per GPU

Exit codes (``trainer.signals``): 0 finished; 75 stopped cleanly on SIGUSR2/SIGTERM after a checkpoint,
requeue to resume; 65 NaN/inf loss in fp32/bf16 (nothing saved; the last good checkpoint is intact); 78 a
failure a retry would repeat (bad config or data, no usable checkpoint, W&B at start-up): its reason is
the last log line, with no traceback.
Everything a run needs to resume exactly lives in its checkpoints; the W&B run id and last logged step
live in ``{run_dir}/wandb_run.json``; log-line values are appended to ``{run_dir}/train_metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer import faults, formulas, health
from trainer.checkpoint import protocol as ckpt
from trainer.checkpoint.chunks import saved_split
from trainer.checkpoint.files import config_differences
from trainer.config import ModelConfig, RunConfig
from trainer.config.train import precision_recipe, recipe_line
from trainer.config_issues import ConfigError
from trainer.convert import dist as dist_ckpt
from trainer.convert.spec import unsupported_options
from trainer.data.tokenizer_identity import TokenizerId, identify
from trainer.disk import folder_bytes
from trainer.goodput import AttemptClock
from trainer.health.rendezvous import Rendezvous, check_rendezvous
from trainer.log import get_logger
from trainer.metrics_file import metrics_path, truncate_after
from trainer.model import attention
from trainer.model.recompute import Recompute
from trainer.ops.dtypes import DTYPES
from trainer.ops.selfcheck import KernelCheck
from trainer.optim.lr import LRSchedule, OptimizerParamScheduler
from trainer.optim.optimizer import build_optimizer
from trainer.optim.precision import ScalerSettings, autocast_dtype, make_scaler
from trainer.parallel import ParallelModel, ParallelState, build_model, init_distributed
from trainer.parallel.dist_optimizer import build_distributed_optimizer
from trainer.parallel.interleaved import check_microbatches
from trainer.parallel.launch import DistEnv
from trainer.restore.dist import restore_dist
from trainer.restore.distrib_optim import is_distributed, read_beside
from trainer.restore.state import (
    Restorable,
    RunFacts,
    TrainState,
    check_tokenizer,
    restore_merged,
    restore_resharded,
    restore_same_layout,
)
from trainer.run import metrics, oom
from trainer.run.choice import LoadCheck, load_checked, resolve_load
from trainer.run.data import DataShape, build_data, resolve_vocab
from trainer.run.host import host_group
from trainer.run.kernels import checked_kernels, optimizer_after_check, use_run_compile_cache
from trainer.run.loop import Cadence, Loop, NonFiniteError, Throughput, train
from trainer.run.saving import Saver
from trainer.signals import (
    EXIT_NONFINITE,
    EXIT_OK,
    EXIT_PERMANENT,
    EXIT_REQUEUE,
    STOP_SIGNALS,
    StopRequest,
    permanent_reason,
)

log = get_logger(__name__)


@dataclass
class RunHooks:
    """Optional callbacks (profiling, tests): after the model is built and loaded, after each iteration."""

    on_build: Callable[[ParallelModel], None] | None = None
    on_step: Callable[[int, float], None] | None = None


@dataclass
class RunResult:
    """What ``run`` reports (on every rank)."""

    exit_code: int
    iteration: int
    losses: dict[int, float] = field(default_factory=dict)  # lm loss per iteration run in this process
    eval_losses: dict[int, float] = field(default_factory=dict)
    skipped_iters: int = 0
    wandb_run_id: str | None = None
    kernel_check: dict | None = None  # the start-up self-check's record (trainer.ops.selfcheck)
    reason: str = ""  # why a run that did not reach train.iters stopped, in one line (status shows it)


def gpt_config(model: ModelConfig, vocab_size: int) -> ModelConfig:
    """The model section with the vocabulary resolved (the GPT's config is the section itself)."""
    return dataclasses.replace(model, vocab_size=vocab_size)


def _apply_recipe(model: ParallelModel, t, distributed: bool) -> str:
    """bf16/fp16 per ``train.precision_recipe``: autocast sets the forward's autocast dtype (weights, grads
    and optimizer stay fp32; backward runs outside it, as PyTorch recommends); master_weights leaves the
    model to the optimizer, which makes its parameters 16-bit. Returns the resolved recipe (logged)."""
    dtype = autocast_dtype(t.precision, t.precision_recipe, distributed)
    if dtype is not None:
        model.autocast = dtype
    log.info("precision: %s", recipe_line(t.precision, t.precision_recipe, distributed))
    return precision_recipe(t.precision, t.precision_recipe, distributed)


def _configure_determinism(deterministic: bool) -> None:
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def load_checkpoint(plan: tuple[str, int, bool], gpt: ModelConfig, model: ParallelModel,
                    parts: Restorable, tok: TokenizerId | None = None) -> TrainState:
    """Restore from ``plan`` (see resolve_load), resharding when the saved (tp, pp) differ; ``tok``: the
    run's tokenizer, which a resumed checkpoint must have been trained with (None: not compared)."""
    state = _load_checkpoint(plan, gpt, model, parts, tok or TokenizerId(None, ""))
    if plan[2] and is_distributed(parts.optimizer):  # weights only: the 16-bit masters follow them
        parts.optimizer.reload_model_params()
    return state


def _load_checkpoint(plan: tuple[str, int, bool], gpt: ModelConfig, model: ParallelModel,
                     parts: Restorable, tok: TokenizerId) -> TrainState:
    ckpt_dir, iteration, model_only = plan
    iter_dir = Path(ckpt.iter_path(ckpt_dir, iteration))
    if dist_ckpt.is_dist(iter_dir):  # Megatron-core's torch_dist: Megatron-LM's (weights only) or Slipway's
        _check_saved(dist_ckpt.read_common(iter_dir).get("args"), gpt, tok, plan)
        return restore_merged(iter_dir, model) if model_only else restore_dist(iter_dir, model, parts)
    tp, pp, args = ckpt.saved_layout(ckpt_dir, iteration)
    _check_saved(args, gpt, tok, plan)
    ps = model.pstate
    restore = None if model_only else parts
    if tp == ps.tp_size and saved_split(args) == model.pcfg.split(gpt.num_layers):  # the same stages
        path = ckpt.shard_path(ckpt_dir, iteration, ps.tp_rank, ps.pp_rank, pp)
        distrib = read_beside(path) if restore is not None else None  # distributed optimizer state
        state = restore_same_layout(ckpt.load_file(path), model, restore, distrib)
    else:
        state = restore_resharded(ckpt_dir, iteration, (tp, pp, args), model, restore)
    log.info("loaded %s from %s iteration %d (consumed samples %d)", "weights" if model_only else
             "checkpoint", ckpt_dir, iteration, state.consumed_train_samples)
    return state


def _check_saved(args: Any, gpt: ModelConfig, tok: TokenizerId, plan: tuple[str, int, bool]) -> None:
    """Before anything is loaded: the saved model is the configured one, trained with this run's tokenizer."""
    _check_model(args, gpt, plan[0], plan[1])
    check_tokenizer(args, tok, plan)


def _check_model(args: Any, gpt: ModelConfig, ckpt_dir: str, iteration: int) -> None:
    """The saved model must be one Slipway's GPT computes, of the configured shape and architecture
    (keys the args leave out are not compared)."""
    unsupported = unsupported_options(args)
    if unsupported:  # the same weights names and shapes, another computation: never load them silently
        raise ckpt.CheckpointError(f"checkpoint {ckpt_dir} iteration {iteration} cannot be loaded: Slipway's "
                                   f"GPT has no such option: {'; and '.join(unsupported)}")
    wrong = config_differences(args, gpt)
    if wrong:
        raise ckpt.CheckpointError(f"checkpoint {ckpt_dir} iteration {iteration} is a different model "
                                   f"(saved, configured): {wrong}; fix the model section or load another")


@dataclass
class Components:
    """This rank's model and what updates it (``build_components``)."""

    gpt: ModelConfig
    model: ParallelModel
    parts: Restorable
    global_batch_size: int
    eod: int | None
    kernel_check: KernelCheck | None = None


def build_components(cfg: RunConfig, pstate: ParallelState, start_iteration: int = 0,
                     init: bool = True) -> Components:
    """Model, optimizer, scheduler and loss scaler for this rank, on the kernels that passed the start-up
    self-check (``train.kernel_check``; its record names ``start_iteration``). ``init=False``: the weights
    are not initialised, a checkpoint's are loaded into all of them next (trainer.parallel.build_model)."""
    t = cfg.train
    gbs = formulas.global_batch_size(t.global_batch_size, t.micro_batch_size, pstate.dp_size)
    vocab_size, eod = resolve_vocab(cfg.model, cfg.tokenizer)
    gpt = gpt_config(cfg.model, vocab_size)
    check = checked_kernels(cfg, gpt, pstate, start_iteration)  # before the model: it takes the checked set
    recompute = Recompute(t.recompute_granularity, t.recompute_method, t.recompute_num_layers)
    model = build_model(gpt, cfg.parallel, pstate, t.seed, kernels=check.kernels, recompute=recompute,
                        init=init)
    log.info("%s", attention.describe(gpt, pstate.device, DTYPES[t.precision], t.micro_batch_size,
                                      pstate.tp_size))  # raises when a named SDPA kernel cannot serve it
    recipe = _apply_recipe(model, t, cfg.optim.distributed)
    optim, opt_kernels = optimizer_after_check(cfg.optim, cfg.kernels, check)
    if optim.distributed or recipe == "master_weights":  # re-lays the parameters and gradient buckets:
        # 16-bit parameters, fp32 gradient buckets and masters (ZeRO-1 over dp; all of them at dp 1)
        optimizer, _ = build_distributed_optimizer(model, optim, t.precision, opt_kernels)
    else:
        optimizer, _ = build_optimizer(model.named_parameters(), optim, pstate.device.type, opt_kernels)
    scheduler = OptimizerParamScheduler(optimizer, LRSchedule.from_iters(cfg.optim, t.iters, gbs))
    scaler = make_scaler(t.precision, ScalerSettings(t.initial_loss_scale, t.loss_scale_window,
                                                     t.hysteresis, t.min_loss_scale))
    return Components(gpt, model, Restorable(optimizer, scheduler, scaler), gbs, eod, check)


def _loop(cfg: RunConfig, b: Components, state: TrainState, hooks: RunHooks, facts: RunFacts,
          monitor: health.Monitor, clock: AttemptClock) -> Loop:
    ps, t = b.model.pstate, cfg.train
    m = formulas.num_microbatches(b.global_batch_size, t.micro_batch_size, ps.dp_size)
    if len(b.model.chunks) > 1:  # refuse at start-up, not at the first step
        check_microbatches(m, ps.pp_size)
    shape = DataShape(b.gpt.seq_length, b.global_batch_size, cfg.run_dir)
    clock.switch("data")
    train_data, valid_data = build_data(cfg.data, cfg.train, shape, ps, state)
    wandb_config = {**cfg.to_dict(), "derived": {"world_size": ps.world_size, "dp_size": ps.dp_size,
                                                 "global_batch_size": b.global_batch_size,
                                                 "num_microbatches": m,
                                                 "kernel_check": b.kernel_check.record() if b.kernel_check
                                                 else None}}
    clock.switch("wandb")
    logger = metrics.WandbLogger(cfg.logging.wandb, cfg.run_dir, cfg.run_id, wandb_config, ps.rank == 0,
                                 state.iteration)
    padded = b.gpt.padded_vocab_size(ps.tp_size)
    flops = formulas.model_flops_per_iteration(b.gpt, b.global_batch_size, padded)
    peak = metrics.detect_peak_tflops(ps.device, cfg.logging.peak_tflops)
    saver = Saver(cfg.checkpoint, b.gpt, b.model, b.parts, facts, clock)  # collective (its group)
    return Loop(
        model=b.model, optimizer=b.parts.optimizer, scheduler=b.parts.scheduler, scaler=b.parts.scaler,
        precision=t.precision, clip_grad=cfg.optim.clip_grad, global_batch_size=b.global_batch_size,
        num_microbatches=m, train_iters=t.iters, train_data=train_data, valid_data=valid_data,
        save=saver, wandb=logger,
        cadence=Cadence(t.log_interval, t.eval_interval, t.eval_iters, t.save_interval),
        throughput=Throughput(flops, b.global_batch_size * b.gpt.seq_length, ps.world_size, peak),
        metrics_file=metrics_path(cfg.run_dir), on_step=hooks.on_step, monitor=monitor,
        kernel_fallbacks=tuple(b.kernel_check.fallbacks) if b.kernel_check else (),
        stop_group=host_group(), clock=clock, background=saver)  # collective: every rank builds its loop


def _start(cfg: RunConfig, pstate: ParallelState | None, hb: health.Monitor, clock: AttemptClock
           ) -> tuple[Components, TrainState, TokenizerId]:
    """Set-up up to the loaded state, each phase on the attempt's clock (trainer.goodput)."""
    if pstate is None:
        clock.switch("rendezvous")
        pstate = init_distributed(cfg.parallel, backend="gloo" if cfg.train.device == "cpu" else None,
                                  before=_rendezvous_check(cfg))
    os.makedirs(cfg.run_dir, exist_ok=True)
    clock.switch("preflight")
    hb.begin(pstate.device)  # heartbeats, then the preflight (multi-rank worlds)
    clock.begin(pstate.rank, pstate.world_size)
    hb.writers.append(clock.write)  # the record is rewritten at every heartbeat
    clock.switch("checkpoint_select")
    chosen: list = []
    plan = resolve_load(cfg.checkpoint, cfg.run_dir, full=False, deferred=chosen)  # sizes now:
    check = LoadCheck.start(plan, chosen)  # checksums while it loads (rank 0, a thread)
    tok = identify(cfg.tokenizer)  # read once: what is checked is what the checkpoints record
    clock.switch("build")
    b = build_components(cfg, pstate, plan[1] if plan and not plan[2] else 0, init=plan is None)
    if b.kernel_check is not None:
        clock.moved(b.kernel_check.seconds, "build", "kernel_check")
    clock.switch("checkpoint_load")
    t0 = time.monotonic()
    plan, state = load_checked(plan, check, lambda p: load_checkpoint(p, b.gpt, b.model, b.parts, tok),
                               lambda: resolve_load(cfg.checkpoint, cfg.run_dir))
    state = state or TrainState()
    if plan:
        clock.loaded(plan[1], folder_bytes(ckpt.iter_path(plan[0], plan[1])), time.monotonic() - t0)
    if pstate.rank == 0:  # the iterations after the checkpoint are logged again: once, not twice
        truncate_after(metrics_path(cfg.run_dir), state.iteration)
    return b, state, tok


def _rendezvous_check(cfg: RunConfig) -> Callable[[DistEnv, str], object] | None:
    """The preflight's look at the rendezvous before the process group waits on it (unless preflight is
    off): a MASTER_ADDR that does not resolve or answer, a socket interface the node lacks."""
    if not cfg.train.preflight:
        return None
    return lambda env, backend: check_rendezvous(cfg.train.health(), Rendezvous(
        env.rank, env.world_size, env.master_addr, env.master_port, backend))


def run(cfg: RunConfig, hooks: RunHooks | None = None, pstate: ParallelState | None = None) -> RunResult:
    """Train per ``cfg``; resumes from ``cfg.checkpoint`` when there is something to resume.

    ``pstate``: an existing layout to train on (the caller keeps ownership of its groups); by default
    torch.distributed is initialised from the environment (torchrun, Slurm, or a world of one). Process
    groups are left alive for the caller (the CLI destroys them at exit): destroying and re-creating a
    group over the same ranks within one process would reuse its store keys.
    """
    hooks = hooks or RunHooks()
    clock = AttemptClock(cfg.run_dir)  # first: the imports are measured up to here
    use_run_compile_cache(cfg.run_dir)
    faults.warn_active(log, os.environ)  # a stray test hook must not go unnoticed in a real job
    metrics.check_wandb_credentials(cfg.logging.wandb.mode)  # before anything slow or collective
    _configure_determinism(cfg.train.deterministic)
    # StopRequest from the start: a signal during set-up stops at the first step boundary.
    with StopRequest() as stop, health.Monitor(cfg.train.health(), cfg.run_dir) as hb, oom.named(cfg, hb):
        b, state, tok = _start(cfg, pstate, hb, clock)
        if hooks.on_build is not None:
            hooks.on_build(b.model)
        facts = RunFacts(cfg.to_dict(), b.global_batch_size, b.eod, cfg.run_id, tok.digest)
        hb.iteration = state.iteration
        loop = _loop(cfg, b, state, hooks, facts, hb, clock)  # the loop's progress ticks arm the watchdog
        reason = ""
        try:
            code = train(loop, state, stop)
        except NonFiniteError as e:  # raised before the failing iteration was counted
            reason = f"training diverged at iteration {state.iteration + 1}: {e}"
            log.error("%s. Stopping without saving: the last good checkpoint in %s is intact. Lower "
                      "optim.lr, check the data, or resume from an earlier iteration.", reason,
                      cfg.checkpoint.dir)
            code = EXIT_NONFINITE
        except BaseException as e:
            # W&B's run ends here, not in W&B's atexit hook: after a cancel its service got the same SIGINT,
            # and the hook's ConnectionResetError traceback would end the log instead of the cause.
            loop.wandb.finish(128 + signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1)
            raise
        finally:
            loop.save.settle()  # a save still in flight (an earlier, good iteration) is committed
    clock.end(code)
    clock.switch("shutdown")
    loop.wandb.finish(0 if code in (EXIT_OK, EXIT_REQUEUE) else code)
    clock.write()
    check = b.kernel_check.record() if b.kernel_check and b.kernel_check.results else None
    return RunResult(code, state.iteration, loop.losses, loop.eval_losses, state.skipped_iters,
                     loop.wandb.run_id, check, reason)


def _override(d: dict, item: str) -> None:
    """Apply ``section.key=value`` (value parsed as YAML) to a nested dict."""
    import yaml

    key, sep, value = item.partition("=")
    if not sep:
        raise SystemExit(f"override {item!r} is not of the form section.key=value")
    node = d
    *parents, leaf = key.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = yaml.safe_load(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.run", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="resolved YAML config (orchestrator output)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.iters=10")
    args = parser.parse_args(argv)
    import yaml

    with open(args.config, encoding="utf-8") as f:
        d = yaml.safe_load(f) or {}
    for item in args.overrides:
        _override(d, item)
    try:
        cfg = RunConfig.from_dict(d)
    except (ConfigError, ValueError) as e:
        # Before any process group: every rank reports the same problems and exits with the code a
        # retry would repeat (the sbatch script does not requeue it), never a per-rank traceback.
        problems = e.issues if isinstance(e, ConfigError) else [e]
        log.error("%s: %d configuration problem(s):\n%s", args.config, len(problems),
                  "\n".join(f"  - {p}" for p in problems))
        return EXIT_PERMANENT
    try:
        code = run(cfg).exit_code
    except Exception as e:
        reason = permanent_reason(e)
        if reason is None:
            raise  # a retry may succeed (a collective, a sick node): the traceback helps whoever looks
        log.error("%s\nA retry would fail the same way: exiting with %d (not retried).", reason,
                  EXIT_PERMANENT)
        code = EXIT_PERMANENT
    for sig in STOP_SIGNALS:  # the run has saved what it had to: late signals must not turn exit 75 into -15
        signal.signal(sig, signal.SIG_IGN)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return code
