"""Where the W&B API key comes from, torch-free: ``WANDB_API_KEY``, else the netrc file's entry for the W&B
host (what ``wandb login`` writes: ``$NETRC`` when set, as wandb reads it, else ``~/.netrc``). The job
checks it before training (trainer/run/metrics.py) and the launch before submitting
(orchestrator/checks/secrets.py): Slurm passes the launching shell's environment to the jobs, and the home
directory holding ``~/.netrc`` is the jobs' too. Never reads the key into anything else."""

from __future__ import annotations

import netrc
import os
from collections.abc import Mapping

from trainer.wandb_online import base_url


def wandb_host(environ: Mapping[str, str]) -> str:
    return base_url(environ).split("://")[-1].split("/")[0]


def netrc_path(environ: Mapping[str, str]) -> str:
    """The netrc file wandb reads: ``$NETRC`` when set, else ``~/.netrc``."""
    return os.path.abspath(os.path.expanduser(environ.get("NETRC") or "~/.netrc"))


def key_source(environ: Mapping[str, str]) -> str | None:
    """Where the key comes from, never the key: ``WANDB_API_KEY`` or the netrc file's path; None: nowhere."""
    if environ.get("WANDB_API_KEY"):
        return "WANDB_API_KEY"
    try:
        found = netrc.netrc(environ.get("NETRC") or None).authenticators(wandb_host(environ))
    except (OSError, netrc.NetrcParseError):
        return None
    return netrc_path(environ) if found else None


def has_wandb_key(environ: Mapping[str, str]) -> bool:
    return key_source(environ) is not None


def missing_key_message(environ: Mapping[str, str]) -> str:
    return (f"logging.wandb.mode=online but no W&B API key was found (WANDB_API_KEY is unset and ~/.netrc "
            f"has no entry for {wandb_host(environ)})")
