"""Test-only hooks: the one list of their names, the switch, the seam, and the warning a job logs when one
is active (torch-free).

Each hook makes a job misbehave on purpose so the fault tests can act at a known point. They are
environment variables, never configuration keys: ``SLIPWAY_*`` is on the container allowlist and Slurm
passes the launching shell's environment to the job, so a stray one would reach a real run. Therefore:

- the plan refuses every hook (orchestrator/checks/secrets.py: ``cluster.env`` and the launching environment)
  unless the switch ``SLIPWAY_TESTING=1`` is set where ``launch.py`` runs;
- the hooks that change what a job computes (a failing start, a stall, a wrong kernel) are implemented in
  ``tests/seam.py``, which :func:`seam` imports only when the switch is on in the job, so the product
  carries no test machinery and a stray hook without the switch does nothing;
- what cannot be caused from outside stays a named failpoint in the product: a SIGKILL at a step of a
  checkpoint save (trainer/checkpoint/protocol.py), of a submission (:func:`launch_failpoint`), a
  stopped or slow preflight, and the emulated node name of the heartbeats;
- a job names each active hook in a warning at start-up.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Mapping
from types import ModuleType

SWITCH = "SLIPWAY_TESTING"  # "1": the hooks are allowed (the tests that use them set it)
SEAM_MODULE = "tests.seam"  # the hooks' implementation, loaded only under the switch

FAIL_TRAIN = "SLIPWAY_FAIL_TRAIN"  # tests/seam.py
FAIL_TRIAL = "SLIPWAY_FAIL_TRIAL"  # tests/seam.py
STALL_TRAIN = "SLIPWAY_STALL_TRAIN"  # tests/seam.py
KERNEL_FAULT = "SLIPWAY_KERNEL_FAULT"  # tests/seam.py
CKPT_FAILPOINT = "SLIPWAY_CKPT_FAILPOINT"  # trainer/checkpoint/protocol.py
CKPT_FAILPOINT_ONCE = "SLIPWAY_CKPT_FAILPOINT_ONCE"
PREFLIGHT_FAILPOINT = "SLIPWAY_PREFLIGHT_FAILPOINT"  # trainer/health/preflight.py
NODE_NAME = "SLIPWAY_NODE_NAME"  # trainer/health/heartbeat.py
LAUNCH_FAILPOINT = "SLIPWAY_LAUNCH_FAILPOINT"  # orchestrator/flow.py, submit.py: launch_failpoint below

# Environment variables → what they do.
ENV_HOOKS = {
    FAIL_TRAIN: "start: the training stage raises at start on purpose",
    FAIL_TRIAL: "<trial>[:oom|hang],...: those layout=auto trials run out of memory or hang on purpose",
    STALL_TRAIN: "every rank pauses after that iteration until a signal arrives",
    KERNEL_FAULT: "makes the named fused ops wrong on purpose (the kernel self-check's tests)",
    CKPT_FAILPOINT: "the process SIGKILLs itself at that point of a checkpoint save",
    CKPT_FAILPOINT_ONCE: "only the first process to create this file is killed by the checkpoint failpoint",
    PREFLIGHT_FAILPOINT: "the preflight stops or slows a node on purpose",
    NODE_NAME: "overrides the node name in heartbeats and the preflight (emulated nodes)",
    LAUNCH_FAILPOINT: "launch.py SIGKILLs itself at that step of a submission (crash-consistency tests)",
}


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def switch_on(environ: Mapping[str, str] | None = None) -> bool:
    return _env(environ).get(SWITCH) == "1"


def seam(environ: Mapping[str, str] | None = None) -> ModuleType | None:
    """The test seam (``tests/seam.py``) when the switch is on, else None: product code calls its hooks
    only through this."""
    return importlib.import_module(SEAM_MODULE) if switch_on(environ) else None


def with_faults(kernels, environ: Mapping[str, str] | None = None):
    """A resolved kernel set with the faults ``SLIPWAY_KERNEL_FAULT`` asks for (the seam's); the set itself
    without the switch."""
    hooks = seam(environ)
    return hooks.inject(kernels, _env(environ)) if hooks is not None else kernels


def active_env_hooks(environ: Mapping[str, str]) -> dict[str, str]:
    """The hook variables set (non-empty) in ``environ``."""
    return {k: environ[k] for k in ENV_HOOKS if environ.get(k)}


def warn_active(log: logging.Logger, environ: Mapping[str, str]) -> list[str]:
    """Log one warning per active hook, naming it and what it does; returns their names."""
    hooks = active_env_hooks(environ)
    for name, value in hooks.items():
        log.warning("TEST HOOK ACTIVE: %s=%s (%s). It exists for Slipway's fault tests only; a real run must "
                    "not set it: remove it and relaunch.", name, value, ENV_HOOKS[name])
    return list(hooks)


def launch_failpoint(step: str, environ: Mapping[str, str] | None = None) -> None:
    """Test hook of the crash-consistency tests: with the switch on (the plan refuses the hook without it)
    and ``SLIPWAY_LAUNCH_FAILPOINT=<step>``, the launching process SIGKILLs itself at that step boundary,
    as a login shell dying there would leave it. Steps: ``recorded``, ``before_sbatch:<stage>``,
    ``after_sbatch:<stage>``, ``after_record:<stage>``, ``submitted``."""
    import signal

    if switch_on(environ) and _env(environ).get(LAUNCH_FAILPOINT) == step:
        os.kill(os.getpid(), signal.SIGKILL)
