"""Machine preparation for ``up``: Debian packages when missing, and /etc/hosts entries: this host's name,
and the nodes' names when every node is this host (single-host mode; as separate hosts the nodes resolve
each other through the cluster's own hosts file, hosts.py)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from .layout import NODES

# charliecloud-runtime: ch-run, the container runtime of the nodes (container=charliecloud; containers/).
PACKAGES = ("slurm-wlm", "slurmdbd", "munge", "mariadb-server", "charliecloud-runtime")
# The programs up needs, and the package that provides each.
PROGRAMS = {
    "slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "srun": "slurm-wlm", "sinfo": "slurm-wlm",
    "sacct": "slurm-wlm", "sacctmgr": "slurm-wlm", "scontrol": "slurm-wlm", "slurmdbd": "slurmdbd",
    "munged": "munge", "mariadbd": "mariadb-server", "mariadb-install-db": "mariadb-server",
    "mariadb": "mariadb-server", "ch-run": "charliecloud-runtime",
}
POLICY_RC = Path("/usr/sbin/policy-rc.d")
HOSTS = Path("/etc/hosts")


class SetupError(RuntimeError):
    """The machine cannot be prepared (not root, apt failure, ...); the message says what to do."""


class Refusal(SetupError):
    """``up`` will not start as asked (no namespaces here, a mode change while running): one line."""


def missing_programs() -> list[str]:
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return [p for p in PROGRAMS if shutil.which(p, path=path) is None]


def ensure_packages(say) -> None:
    """Install the Debian packages providing any missing program (root only; no service is started)."""
    missing = missing_programs()
    if not missing:
        return
    if os.geteuid() != 0:
        raise SetupError(f"missing programs {', '.join(missing)}; installing them needs root. Run as root, "
                         f"or first: sudo apt-get install -y {' '.join(PACKAGES)}")
    if shutil.which("apt-get") is None:
        raise SetupError(f"missing programs {', '.join(missing)} and no apt-get here: install "
                         f"{' '.join(PACKAGES)} (Slurm, slurmdbd, MUNGE, MariaDB) with your package manager")
    say(f"{', '.join(missing)} missing: installing {' '.join(PACKAGES)} with apt-get (output on stderr)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # policy-rc.d answering 101 stops the packages from starting system-wide services: we run our own.
    created_policy = not POLICY_RC.exists()
    if created_policy:
        POLICY_RC.write_text("#!/bin/sh\n# slurm/devcluster, for the duration of apt-get\nexit 101\n")
        POLICY_RC.chmod(0o755)
    try:
        _apt(["apt-get", "update"], env)
        _apt(["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES], env)
    finally:
        if created_policy:
            POLICY_RC.unlink(missing_ok=True)
    still = missing_programs()
    if still:
        raise SetupError(f"apt-get finished but {', '.join(still)} still missing from PATH")


def _apt(argv: list[str], env: dict[str, str]) -> None:
    res = subprocess.run(argv, env=env, stdout=sys.stderr, stderr=sys.stderr, stdin=subprocess.DEVNULL)
    if res.returncode != 0:
        raise SetupError(f"`{' '.join(argv)}` failed with status {res.returncode} (its output is above)")


def _resolves_to_loopback(name: str) -> bool:
    try:
        return socket.gethostbyname(name).startswith("127.")
    except OSError:
        return False


def _resolves(name: str) -> bool:
    try:
        socket.gethostbyname(name)
        return True
    except OSError:
        return False


def ensure_hosts(say, hostname: str, node_names: bool = True) -> None:
    """Make this host's name resolve at all (srun binds to it) and, with ``node_names`` (every node is this
    host), the node names resolve to 127.0.0.1.

    Idempotent: appends at most one line to /etc/hosts, only for names that do not resolve as needed.
    """
    names = [n for n in NODES if node_names and not _resolves_to_loopback(n)]
    names += [] if _resolves(hostname) else [hostname]
    if not names:
        return
    line = f"127.0.0.1 {' '.join(names)}  # slipway devcluster"
    if os.geteuid() != 0:
        raise SetupError(f"{', '.join(names)} do not resolve to 127.0.0.1; as root, add to {HOSTS}:\n"
                         f"  {line}")
    text = HOSTS.read_text() if HOSTS.exists() else ""
    # Append in place (not write-and-rename): in containers /etc/hosts is often a bind mount.
    with open(HOSTS, "a") as f:
        f.write(("" if text.endswith("\n") or not text else "\n") + line + "\n")
    say(f"added to {HOSTS}: {line}")
    bad = [n for n in names if not _resolves_to_loopback(n)]
    if bad:
        raise SetupError(f"{', '.join(bad)} still do not resolve to 127.0.0.1 after editing {HOSTS} "
                         "(an earlier line or DNS wins? check /etc/hosts and /etc/nsswitch.conf)")
