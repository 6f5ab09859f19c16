"""The kernel side of a run (``trainer.run``): resolve the ``kernels`` key, refuse a CUDA run whose kernel
setting expects the compiled kernels when there are none (in a container: the image's build, see
trainer/extension.py), record which build every rank loaded, self-check the fused ops on this job's
device and dtypes (trainer.ops.selfcheck, ``train.kernel_check``), record the verdict, and keep the
optimizer off a csrc AdamW kernel that failed it. Glue only."""

from __future__ import annotations

import dataclasses
import os
import time

import torch.distributed as dist

from trainer import extension, faults
from trainer.config import COMPILED_KERNEL_SETS, OptimConfig, RunConfig
from trainer.config.model import ModelConfig
from trainer.log import get_logger
from trainer.metrics_file import KERNEL_BUILDS, KERNEL_CHECK, append_record, metrics_path
from trainer.ops import csrc_available, resolve
from trainer.ops.dtypes import DTYPES
from trainer.ops.selfcheck import (
    CheckSetup,
    CheckShapes,
    KernelCheck,
    KernelCheckError,
    agree,
    fail_message,
    run_check,
)
from trainer.optim.precision import param_dtype, uses_master_weights
from trainer.parallel import ParallelState
from trainer.run.layer_check import check_compiled_layer
from trainer.run_files import RunDir

log = get_logger(__name__)


class KernelsMissingError(ValueError):
    """A CUDA run expects the compiled kernels and has none (a ValueError: a retry would repeat it)."""


def require_compiled(kernels: str, device_type: str) -> None:
    """On CUDA, ``kernels`` in COMPILED_KERNEL_SETS needs a build with CUDA kernels (rather than training
    on eager fallbacks); on CPU the fallbacks stay, with the warning extension.load gives."""
    if device_type == "cuda" and kernels in COMPILED_KERNEL_SETS and not csrc_available("cuda"):
        raise KernelsMissingError(f"kernels={kernels}: {extension.missing_message('cuda')}; nothing was "
                                  "trained")


INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def use_run_compile_cache(run_dir: str) -> str:
    """Keep torch.compile's cache (Inductor's compiled graphs and kernels, Triton's under it) in the run
    directory unless the job's environment names one: its default lives in the node's temporary folder,
    which a requeued or retried job on another node (or with a job-private /tmp) never sees again, so every
    restart compiled again (kernels=compile, compile_layer: the slowest part of start-up). Call it before
    anything imports torch._inductor (train.deterministic does), which may settle the folder. Returns it."""
    cache = os.environ.get(INDUCTOR_CACHE_ENV)
    if not cache:
        cache = os.environ[INDUCTOR_CACHE_ENV] = str(RunDir(run_dir).compile_cache)
    return cache


def record_builds(run_dir: str, rank: int, start_iteration: int) -> list[dict]:
    """Which build of trainer._C every rank loaded (gathered on rank 0, which appends it to the metrics
    file and logs it): a container run shows its kernels came from the image, and a node whose image
    differs from the others' shows up."""
    mine = extension.origin()
    builds = [mine]
    if dist.is_available() and dist.is_initialized():
        builds = [None] * dist.get_world_size()
        dist.all_gather_object(builds, mine)
    if rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        append_record(metrics_path(run_dir), {"iteration": start_iteration, KERNEL_BUILDS: builds})
        paths = sorted({str(b.get("path")) for b in builds})
        log.info("compiled kernels on %d rank(s): %s", len(builds), "; ".join(paths))
        if len(paths) > 1:
            log.warning("the ranks loaded different builds of trainer._C: %s", paths)
    return builds


def check_setup(cfg: RunConfig, gpt: ModelConfig, pstate: ParallelState) -> CheckSetup:
    """The device, the dtypes the kernels see and the shapes of this rank's shard: activations in the
    compute dtype, parameters in theirs (fp32 under autocast, so the ops see bf16 activations with fp32
    weights and biases); the parameters' dtype is checked as an activation dtype too (eval and fp32 paths)."""
    t = cfg.train
    params = param_dtype(t.precision, uses_master_weights(t.precision, t.precision_recipe,
                                                          cfg.optim.distributed))
    shapes = CheckShapes.for_model(gpt, pstate.tp_size, gpt.padded_vocab_size(pstate.tp_size))
    return CheckSetup(pstate.device, tuple(dict.fromkeys((DTYPES[t.precision], params))), params, shapes)


def checked_kernels(cfg: RunConfig, gpt: ModelConfig, pstate: ParallelState, start_iteration: int = 0
                    ) -> KernelCheck:
    """The kernel set the run uses after the self-check; the verdict is appended to the metrics file
    (rank 0). Raises :class:`KernelCheckError` under ``train.kernel_check=fail`` when an op failed."""
    require_compiled(cfg.kernels, pstate.device.type)
    if cfg.kernels in COMPILED_KERNEL_SETS:  # eager/compile load no build: nothing to record
        record_builds(cfg.run_dir, pstate.rank, start_iteration)
    kernels = faults.with_faults(resolve(cfg.kernels, pstate.device.type))  # a test hook, if on
    setup = check_setup(cfg, gpt, pstate)
    check = run_check(kernels, setup, cfg.train.kernel_check)
    if kernels.compile_layers and check.policy != "off":
        _check_layer(check, gpt, setup)
    if check.results and pstate.rank == 0:
        os.makedirs(cfg.run_dir, exist_ok=True)
        append_record(metrics_path(cfg.run_dir), {"iteration": start_iteration, KERNEL_CHECK: check.record()})
    if check.fallbacks and check.policy == "fail":
        raise KernelCheckError(f"{fail_message(check)}. train.kernel_check=fail: nothing was trained "
                               "(train.kernel_check=fallback trains with the eager ops instead)")
    return check


def _check_layer(check: KernelCheck, gpt: ModelConfig, setup) -> None:
    """kernels=compile_layer: the compiled layer against eager (trainer.run.layer_check), agreed over the
    ranks and recorded with the ops; a failure under ``fallback`` keeps the per-op set for this run."""
    t0 = time.perf_counter()
    layer = agree([check_compiled_layer(gpt, setup.device, setup.dtypes[0], setup.param_dtype)])[0]
    check.seconds += time.perf_counter() - t0
    check.results.append(layer)
    if layer.ok:
        log.info("kernel self-check: the compiled transformer layer agrees with the eager one (max error "
                 "%.3g, allowed %.3g) in %.1f s", layer.max_error, layer.tolerance, time.perf_counter() - t0)
    elif check.policy == "fallback":
        log.warning("kernel self-check: %s; the layers run the per-op kernels for this run "
                    "(train.kernel_check=fallback). Fix: kernels=csrc, or a torch/compiler that compiles "
                    "this model correctly", layer.describe())
        check.kernels = dataclasses.replace(check.kernels, compile_layers=False)


def optimizer_after_check(optim: OptimConfig, kernels: str, check: KernelCheck) -> tuple[OptimConfig, str]:
    """(optim section, kernels mode) for building the optimizer: when the csrc AdamW kernel failed the
    check, ``auto`` must not pick it and an explicit ``optim.impl=csrc`` becomes torch's loop (the math
    the reference is), with a warning."""
    if "adamw_step" not in check.fallbacks:
        return optim, kernels
    if optim.impl == "csrc":
        log.warning("optim.impl=csrc, but the csrc AdamW kernel failed the self-check: using torch's AdamW "
                    "loop (for_loop) for this run")
        optim = dataclasses.replace(optim, impl="for_loop")
    return optim, "eager"
