"""Test-only hooks: the one list of their names, and the warning a job logs when one is active (torch-free).

Each hook makes a job misbehave on purpose so the fault tests can act at a known point. They are inert by
default, but ``SLIPWAY_*`` is on the container allowlist and Slurm passes the launching shell's
environment to the job, so a stray one would reach a real run. Therefore the plan refuses every hook
(orchestrator/guards.py: config fields, ``cluster.env`` and the launching environment) unless the config
sets the switch ``testing=true``, and a job names each active hook in a warning at start-up.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

SWITCH = "testing"  # the SlipwayConfig field that allows the hooks (the tests that use them set it)

# SlipwayConfig fields (orchestrator-only; the training stage acts on them) → what they do.
CONFIG_HOOKS = {
    "fail_train": "training raises at start on purpose",
    "stall_train": "every rank pauses after that iteration until a signal arrives",
}

CKPT_FAILPOINT = "SLIPWAY_CKPT_FAILPOINT"  # trainer/checkpoint/protocol.py
CKPT_FAILPOINT_ONCE = "SLIPWAY_CKPT_FAILPOINT_ONCE"
PREFLIGHT_FAILPOINT = "SLIPWAY_PREFLIGHT_FAILPOINT"  # trainer/health/preflight.py
NODE_NAME = "SLIPWAY_NODE_NAME"  # trainer/health/heartbeat.py
KERNEL_FAULT = "SLIPWAY_KERNEL_FAULT"  # trainer/ops/inject.py
LAUNCH_FAILPOINT = "SLIPWAY_LAUNCH_FAILPOINT"  # orchestrator/flow.py, submit.py: launch_failpoint below

# Environment variables read by the trainer → what they do.
ENV_HOOKS = {
    CKPT_FAILPOINT: "the process SIGKILLs itself at that point of a checkpoint save",
    CKPT_FAILPOINT_ONCE: "only the first process to create this file is killed by the checkpoint failpoint",
    PREFLIGHT_FAILPOINT: "the preflight stops or slows a node on purpose",
    NODE_NAME: "overrides the node name in heartbeats and the preflight (emulated nodes)",
    KERNEL_FAULT: "makes the named fused ops wrong on purpose (the kernel self-check's tests)",
    LAUNCH_FAILPOINT: "launch.py SIGKILLs itself at that step of a submission (crash-consistency tests)",
}


def active_env_hooks(environ: Mapping[str, str]) -> dict[str, str]:
    """The hook variables set (non-empty) in ``environ``."""
    return {k: environ[k] for k in ENV_HOOKS if environ.get(k)}


def active_hooks(environ: Mapping[str, str], config: Mapping[str, object] | None = None) -> dict[str, str]:
    """Every active hook: config hooks that are set (``config``: field → value) and environment ones."""
    out = {k: str(v) for k, v in (config or {}).items() if k in CONFIG_HOOKS and v not in (None, "")}
    out.update(active_env_hooks(environ))
    return out


def warn_active(log: logging.Logger, environ: Mapping[str, str],
                config: Mapping[str, object] | None = None) -> list[str]:
    """Log one warning per active hook, naming it and what it does; returns their names."""
    hooks = active_hooks(environ, config)
    what = {**CONFIG_HOOKS, **ENV_HOOKS}
    for name, value in hooks.items():
        log.warning("TEST HOOK ACTIVE: %s=%s (%s). It exists for Slipway's fault tests only; a real run must "
                    "not set it: remove it and relaunch.", name, value, what[name])
    return list(hooks)


def launch_failpoint(testing: bool, step: str, environ: Mapping[str, str] | None = None) -> None:
    """Test hook of the crash-consistency tests: with the switch on (``testing=true``; the plan refuses the
    hook without it) and ``SLIPWAY_LAUNCH_FAILPOINT=<step>``, the launching process SIGKILLs itself at
    that step boundary, as a login shell dying there would leave it. Steps: ``recorded``,
    ``before_sbatch:<stage>``, ``after_sbatch:<stage>``, ``after_record:<stage>``, ``submitted``."""
    import os
    import signal

    if testing and (environ if environ is not None else os.environ).get(LAUNCH_FAILPOINT) == step:
        os.kill(os.getpid(), signal.SIGKILL)
