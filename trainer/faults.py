"""Fault injection: the one seam through which Slipway's fault tests make a job misbehave at a known
point, a no-op unless a fault plugin is loaded (torch-free).

The product marks each point a fault test must reach with :func:`at` (a step of a checkpoint save, of a
submission, of the preflight; a training rank's start) and asks for optional behaviour with :func:`hook`
(a step hook, a kernel set made wrong). Both go to the plugin: the importable module that
``SLIPWAY_FAULT_PLUGIN`` names, loaded only where the switch ``SLIPWAY_TESTING=1`` is on too. A plugin
defines ``at(point, **where)``, ``inject(kernels, environ)`` and the hooks asked for by name
(``train_on_step``, ``trial_on_step``); the product names none (Slipway's tests set theirs), so a real
job carries no test machinery and a stray hook variable does nothing.

The hooks are environment variables, never configuration keys: ``SLIPWAY_*`` is on the container
allowlist and Slurm passes the launching shell's environment to the job, so a stray one would reach a real
run. Therefore the plan refuses every one (orchestrator/checks/secrets.py: ``cluster.env`` and the
launching environment) unless the switch is set where ``launch.py`` runs, and a job names each active
hook in a warning at start-up. ``SLIPWAY_NODE_NAME`` alone acts without the plugin (emulated nodes:
trainer/health/heartbeat.py).
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Mapping
from types import ModuleType
from typing import Any

SWITCH = "SLIPWAY_TESTING"  # "1": the hooks are allowed (the tests that use them set it)
PLUGIN = "SLIPWAY_FAULT_PLUGIN"  # the importable module that implements the hooks, loaded under the switch

FAIL_TRAIN = "SLIPWAY_FAIL_TRAIN"
FAIL_TRIAL = "SLIPWAY_FAIL_TRIAL"
STALL_TRAIN = "SLIPWAY_STALL_TRAIN"
CRASH_TRAIN = "SLIPWAY_CRASH_TRAIN"
KERNEL_FAULT = "SLIPWAY_KERNEL_FAULT"
CKPT_FAILPOINT = "SLIPWAY_CKPT_FAILPOINT"
CKPT_FAILPOINT_ONCE = "SLIPWAY_CKPT_FAILPOINT_ONCE"
PREFLIGHT_FAILPOINT = "SLIPWAY_PREFLIGHT_FAILPOINT"
NODE_NAME = "SLIPWAY_NODE_NAME"
LAUNCH_FAILPOINT = "SLIPWAY_LAUNCH_FAILPOINT"
CONVERT_FAILPOINT = "SLIPWAY_CONVERT_FAILPOINT"

# Environment variables → what they do.
ENV_HOOKS = {
    FAIL_TRAIN: "start | oom@<rank>:<iteration>: the training stage raises at start, or that rank runs out "
                "of memory after that iteration, on purpose",
    FAIL_TRIAL: "<trial>[:oom|hang],...: those layout=auto trials run out of memory or hang on purpose",
    STALL_TRAIN: "every rank pauses after that iteration until a signal arrives",
    CRASH_TRAIN: "<iteration>,...: a training rank SIGKILLs itself after each of them, once per run",
    KERNEL_FAULT: "makes the named fused ops wrong on purpose (the kernel self-check's tests)",
    CKPT_FAILPOINT: "the process SIGKILLs itself at that point of a checkpoint save",
    CKPT_FAILPOINT_ONCE: "only the first process to create this file is killed by the checkpoint failpoint",
    PREFLIGHT_FAILPOINT: "the preflight stops or slows a node on purpose",
    NODE_NAME: "overrides the node name in heartbeats and the preflight (emulated nodes)",
    LAUNCH_FAILPOINT: "launch.py SIGKILLs itself at that step of a submission (crash-consistency tests)",
    CONVERT_FAILPOINT: "the HF conversion SIGKILLs itself at that step (written, between_renames)",
}


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


def switch_on(environ: Mapping[str, str] | None = None) -> bool:
    return _env(environ).get(SWITCH) == "1"


def plugin(environ: Mapping[str, str] | None = None) -> ModuleType | None:
    """The fault plugin ``SLIPWAY_FAULT_PLUGIN`` names when the switch is on, else None."""
    name = _env(environ).get(PLUGIN)
    return importlib.import_module(name) if name and switch_on(environ) else None


def at(point: str, **where: Any) -> Any:
    """A fault point (``"checkpoint:mid_write"``, ``"launch:recorded"``, ...): the plugin's ``at`` acts
    there (a SIGKILL, a delay it returns); None without a plugin."""
    faults = plugin()
    return faults.at(point, **where) if faults is not None else None


def hook(name: str, *args: Any) -> Any:
    """The plugin's ``name(*args)`` (e.g. a step hook), None without a plugin."""
    faults = plugin()
    return getattr(faults, name)(*args) if faults is not None else None


def with_faults(kernels, environ: Mapping[str, str] | None = None):
    """A resolved kernel set with the faults ``SLIPWAY_KERNEL_FAULT`` asks for (the plugin's); the set itself
    without a plugin."""
    faults = plugin(environ)
    return faults.inject(kernels, _env(environ)) if faults is not None else kernels


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
