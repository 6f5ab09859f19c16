"""The kernel side of a run (``trainer.run``): resolve the ``kernels`` key, self-check the fused ops on
this job's device and dtypes (trainer.ops.selfcheck, ``train.kernel_check``), record the verdict, and keep
the optimizer off a csrc AdamW kernel that failed it. Glue only."""

from __future__ import annotations

import dataclasses
import os
import time

from trainer import testing_hooks
from trainer.config import OptimConfig, RunConfig
from trainer.config.model import ModelConfig
from trainer.log import get_logger
from trainer.metrics_file import KERNEL_CHECK, append_record, metrics_path
from trainer.ops import resolve
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

log = get_logger(__name__)


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
    kernels = testing_hooks.with_faults(resolve(cfg.kernels, pstate.device.type))  # a test hook, if on
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
