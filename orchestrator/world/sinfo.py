"""The partitions of the Slurm cluster the launch talks to, as ``sinfo`` reports them: their nodes, each
node's CPUs, memory and GPUs (``gres/gpu``), and the partition's time limit (MaxTime). Read by the plan's
partition check (checks/cluster.py), so a job no node of its partition can hold, or one longer than the
partition allows, is refused before it is submitted, not left pending (or refused by sbatch half-way
through a launch, after its upstream jobs were queued)."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

from orchestrator.base.config_keys import slurm_minutes

# One line per node and partition: partition (the default one ends with "*"), node, CPUs, memory (MB),
# generic resources (e.g. "gpu:4", "gpu:a100:4(S:0-1)", "gpu:a100:2,gpu:v100:2", "(null)"), and the
# partition's MaxTime as Slurm writes times: "infinite", "30:00" (MaxTime=30), "1:30:00", "2-12:30:00"
# (printed so by sinfo 22.05 for MaxTime=30, 90 and 2-12:30:00).
SINFO_FORMAT = "%P|%N|%c|%m|%G|%l"
_GPU = re.compile(r"(?:^|,)gpu(?::[^:,]+)?:(\d+)")


@dataclass(frozen=True)
class NodeShape:
    name: str
    cpus: int
    memory_mb: int
    gpus: int


@dataclass(frozen=True)
class Partition:
    name: str
    default: bool
    nodes: tuple[NodeShape, ...]
    max_time_min: int | None = None  # MaxTime in minutes; None: infinite

    @property
    def max_gpus(self) -> int:
        return max((n.gpus for n in self.nodes), default=0)

    @property
    def max_cpus(self) -> int:
        return max((n.cpus for n in self.nodes), default=0)

    @property
    def max_memory_mb(self) -> int:
        return max((n.memory_mb for n in self.nodes), default=0)


def gpus_of(gres: str) -> int:
    """GPUs in a node's sinfo %G field (every type counted; socket affinity such as "(S:0-1)" dropped)."""
    return sum(int(n) for n in _GPU.findall(re.sub(r"\([^)]*\)", "", gres)))


def _int(text: str) -> int:
    digits = re.match(r"\d+", text.strip())
    return int(digits.group()) if digits else 0


def time_limit_min(text: str) -> int | None:
    """A Slurm time limit as sinfo prints it ([DAYS-]HOURS:MINUTES:SECONDS, MINUTES:SECONDS, MINUTES) in
    whole minutes; None for "infinite" (or anything else that is no limit, such as "n/a"). Slurm's one time
    grammar is read in one place (:func:`~orchestrator.base.config_keys.slurm_minutes`)."""
    return slurm_minutes(text)


def parse(text: str) -> dict[str, Partition]:
    """``sinfo -h -N -o SINFO_FORMAT`` output → {partition name: Partition}."""
    nodes: dict[str, list[NodeShape]] = {}
    default: set[str] = set()
    limit: dict[str, int | None] = {}
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 6:
            continue
        part, node, cpus, mem, gres, time = fields
        if part.endswith("*"):
            part = part[:-1]
            default.add(part)
        nodes.setdefault(part, []).append(NodeShape(node, _int(cpus), _int(mem), gpus_of(gres)))
        limit[part] = time_limit_min(time)
    return {p: Partition(p, p in default, tuple(ns), limit[p]) for p, ns in nodes.items()}


def partitions(timeout_s: float = 20.0) -> dict[str, Partition] | None:
    """The cluster's partitions, or None when Slurm does not answer here (no sinfo, no controller)."""
    try:
        res = subprocess.run(["sinfo", "-h", "-N", "-o", SINFO_FORMAT], capture_output=True, text=True,
                             timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if res.returncode != 0:
        return None
    return parse(res.stdout)
