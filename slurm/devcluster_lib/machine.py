"""What this machine gives the cluster: its CPU topology and memory, as slurmd itself detects them, and
whether Slurm may use cgroups here.

Every node of the devcluster is a copy of this machine (all slurmd daemons run on it), so each declares the
machine's real sockets, cores and threads: task/affinity then binds a task to CPUs that exist, exactly as
on a real node. Declaring more CPUs than the machine has (as the devcluster once did) makes Slurm bind
tasks to CPU ids the kernel refuses.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

# Memory each node declares (MB), at most: real nodes have their own, ours share this machine's, and the
# tests' jobs ask for a few GB. 90% of the machine when it has less.
NODE_MEMORY_CAP_MB = 8192
CGROUP_ROOT = Path("/sys/fs/cgroup")
# The cgroup v1 controllers the cgroup plugins use: cpuset (task/cgroup ConstrainCores), memory
# (ConstrainRAMSpace) and freezer (proctrack/cgroup suspends and signals a job's processes through it).
CGROUP_CONTROLLERS = ("cpuset", "memory", "freezer")


@dataclass(frozen=True)
class Machine:
    """The node shape every slurmd declares, and how Slurm may confine jobs here."""

    sockets: int
    cores_per_socket: int
    threads_per_core: int
    memory_mb: int  # what each node declares (RealMemory)
    cgroup_problem: str | None  # None: cgroup v1 is usable; else why the cluster binds with affinity only

    @property
    def cpus(self) -> int:
        return self.sockets * self.cores_per_socket * self.threads_per_core

    @property
    def cgroups(self) -> bool:
        return self.cgroup_problem is None


def _meminfo_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    raise RuntimeError("MemTotal missing from /proc/meminfo")


def topology(env: dict[str, str]) -> dict[str, int]:
    """Sockets, cores per socket and threads per core from ``slurmd -C`` (what slurmd checks a node's
    declaration against); the CPU count os.sched_getaffinity allows when slurmd cannot tell."""
    try:
        out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30, env=env).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    found = dict(re.findall(r"\b(SocketsPerBoard|CoresPerSocket|ThreadsPerCore|Boards)=(\d+)", out))
    if {"SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore"} <= found.keys():
        boards = int(found.get("Boards", 1))
        return {"sockets": boards * int(found["SocketsPerBoard"]),
                "cores_per_socket": int(found["CoresPerSocket"]),
                "threads_per_core": int(found["ThreadsPerCore"])}
    return {"sockets": 1, "cores_per_socket": len(os.sched_getaffinity(0)), "threads_per_core": 1}


def _v1_mounts() -> set[str]:
    """The cgroup v1 controllers mounted at /sys/fs/cgroup/<controller>."""
    found = set()
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 3 and parts[2] == "cgroup" and parts[1].startswith(f"{CGROUP_ROOT}/"):
                name = parts[1].rsplit("/", 1)[1]
                if name in parts[3].split(","):
                    found.add(name)
    return found


def cgroup_problem(probe_name: str) -> str | None:
    """None when Slurm's cgroup/v1 plugin can confine jobs here: cpuset, memory and freezer are mounted
    as cgroup v1 under /sys/fs/cgroup and we may create cgroups in them (a probe is made and removed).
    Otherwise why not (cgroup v2 alone needs slurmd under systemd on Slurm 22.05; containers often mount
    the cgroup tree read-only)."""
    if os.geteuid() != 0:
        return "not root (slurmd creates the job cgroups)"
    mounted = _v1_mounts()
    missing = [c for c in CGROUP_CONTROLLERS if c not in mounted]
    if missing:
        return (f"no cgroup v1 {', '.join(missing)} under {CGROUP_ROOT} (Slurm 22.05's cgroup/v2 plugin "
                "needs slurmd started by systemd)")
    for controller in CGROUP_CONTROLLERS:
        probe = CGROUP_ROOT / controller / probe_name
        try:
            probe.mkdir(exist_ok=True)
            probe.rmdir()
        except OSError as exc:
            return f"cannot create a cgroup in {CGROUP_ROOT / controller} ({exc.strerror})"
    return None


def detect(env: dict[str, str], probe_name: str) -> Machine:
    memory = min(NODE_MEMORY_CAP_MB, int(_meminfo_mb() * 0.9))
    return Machine(**topology(env), memory_mb=memory, cgroup_problem=cgroup_problem(probe_name))

