"""The devcluster is as strict as a real site, and the rendered job scripts are right on it.

- Two partitions: ``cpu`` (default) and ``gpu``, whose nodes carry ``gres/gpu``; a request for more CPUs,
  memory or GPUs than a node has is refused by Slurm.
- Tasks are bound to the CPUs they were given (task/affinity; and task/cgroup, whose memory limit is the
  job's request, where the machine has cgroup v1).
- The job scripts orchestrator/render.py writes give each rank exactly the CPUs it asked for. Since Slurm
  22.05 srun does not take the allocation's --cpus-per-task (SLURM_CPUS_PER_TASK), so every srun passes
  it. Where a step gets the whole allocation (22.05's default) slurmctld divides the allocation's CPUs
  among the tasks when they divide evenly; where steps get only what they ask for (``srun --exact``, which
  ``SLURM_EXACT=1`` sets, as sites that run steps side by side do; Slurm 20.11's default), a step without
  --cpus-per-task gets one CPU per task: each rank, and a preprocessing job's workers, on one core. The
  CPU tests run both ways. Each training rank on a GPU node sees its node's GPUs and uses its own
  (``CUDA_VISIBLE_DEVICES[SLURM_LOCALID]``: the trainer's ``cuda:<local rank>``,
  trainer/parallel/launch.py), distinct from the other ranks of its node.

Needs the devcluster (``make test`` brings it up). Cost: ~4 short jobs, ~30 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.base.plan_types import JobResources
from orchestrator.render import ScriptSpec, render_sbatch
from tests.slurm_cli import sacct_final_state, slurm

pytestmark = pytest.mark.slurm

# What each task reports: the CPUs it may run on, its place, and the GPUs Slurm gave it.
PROBE = """
import json, os, sys
keys = ("SLURMD_NODENAME", "SLURM_PROCID", "SLURM_LOCALID", "CUDA_VISIBLE_DEVICES", "SLURM_JOB_GPUS",
        "SLURM_STEP_GPUS", "SLURM_CPUS_PER_TASK")
row = {k: os.environ.get(k) for k in keys}
row["cpus"] = sorted(os.sched_getaffinity(0))
with open(os.path.join(sys.argv[1], "rank%s.json" % os.environ["SLURM_PROCID"]), "w") as f:
    json.dump(row, f)
"""


def _partitions() -> dict[str, dict]:
    out = {}
    for line in slurm("sinfo", "-h", "-N", "-o", "%P|%N|%c|%m|%G").split():
        part, node, cpus, mem, gres = line.split("|")
        out.setdefault(part, {})[node] = {"cpus": int(cpus), "mem": int(mem), "gres": gres}
    return out


def test_cpu_and_gpu_partitions_with_gres_gpus():
    parts = _partitions()
    assert set(parts["cpu*"]) == {"n1", "n2"}  # the default partition
    assert set(parts["gpu"]) == {"g1", "g2"}
    assert all(n["gres"].startswith("gpu:2") for n in parts["gpu"].values())
    assert all(n["gres"] == "(null)" for n in parts["cpu*"].values())
    # Every node is this machine: the CPUs a task may be bound to exist.
    assert all(n["cpus"] == len(os.sched_getaffinity(0)) for p in parts.values() for n in p.values())


@pytest.mark.parametrize("ask", [["-c", "{cpus_plus_one}"], ["--mem", "{mem_plus_one}"],
                                 ["-p", "gpu", "--gpus-per-node=3"], ["--gpus-per-node=1"]])
def test_a_request_no_node_can_hold_is_refused(ask):
    node = _partitions()["cpu*"]["n1"]
    words = [a.format(cpus_plus_one=node["cpus"] + 1, mem_plus_one=node["mem"] + 1) for a in ask]
    res = subprocess.run(["srun", "-t", "1", *words, "true"], capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "Requested node configuration is not available" in res.stderr, res.stderr


# One task's CPUs, its memory cgroup and that cgroup's job-level limit (cgroup v1 paths).
CONFINED = """
import json, os
groups = dict(line.split(":", 2)[1:] for line in open("/proc/self/cgroup").read().splitlines())
memory = groups.get("memory", "")
job = memory.split("/step_")[0]
limit = open(f"/sys/fs/cgroup/memory{job}/memory.limit_in_bytes").read() if "/job_" in job else None
print(json.dumps({"cpus": sorted(os.sched_getaffinity(0)), "memory": memory, "limit": limit}))
"""


def test_tasks_are_bound_and_confined_as_configured():
    """task/affinity always; where up chose cgroups, the job's memory cgroup holds exactly its --mem."""
    config = slurm("scontrol", "show", "config")
    assert "task/affinity" in config
    out = slurm("srun", "-t", "1", "-n1", "-c1", "--mem=300M", "python3", "-c", CONFINED, timeout=120)
    row = json.loads(out)
    assert len(row["cpus"]) == 1, row
    if "task/cgroup" in config:
        assert "/job_" in row["memory"] and int(row["limit"]) == 300 * 1024 * 1024, row


def _run_rendered(tmp_path: Path, resources: JobResources, exact: bool = False) -> list[dict]:
    """Submit the script render_sbatch writes for ``resources`` with the probe as the per-task command
    (``exact``: with SLURM_EXACT=1 in the job's environment); the rows the tasks wrote."""
    out = tmp_path / "ranks"
    out.mkdir()
    (tmp_path / "probe.py").write_text(PROBE)
    spec = ScriptSpec(resources, f"{sys.executable} {tmp_path / 'probe.py'} {out}", str(tmp_path / "logs"),
                      "probe", "r1", str(tmp_path / "state"))
    (tmp_path / "logs").mkdir()
    script = tmp_path / "job.sh"
    script.write_text(render_sbatch(spec))
    env = {k: v for k, v in os.environ.items() if k != "SLURM_EXACT"}
    job = slurm("sbatch", "--parsable", str(script), env={**env, **({"SLURM_EXACT": "1"} if exact else {})})
    job = job.strip().split(";")[0]
    state = sacct_final_state(job)
    logs = "\n".join(p.read_text() for p in sorted((tmp_path / "logs").glob("*")))
    assert state == "COMPLETED", f"{state}\n{logs}"
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


@pytest.mark.parametrize("exact", [False, True], ids=["whole", "exact"])
def test_a_cpu_stage_gets_the_cpus_it_asked_for(tmp_path, exact):
    """The preprocessing job's shape (one task, stage_cpus): without srun --cpus-per-task an exact step
    runs it on one CPU."""
    [row] = _run_rendered(tmp_path, JobResources("slipway-probe-cpu", cpus_per_task=2, time_limit_min=5,
                                                 partition="cpu"), exact)
    assert len(row["cpus"]) == 2, row


def test_training_ranks_get_their_cpus_and_their_own_gpu(tmp_path):
    """A training job's shape on the gpu partition (2 nodes x 2 tasks, a CPU and a GPU each): every rank
    is bound to one CPU of its own on its node, and uses a GPU of its own among those Slurm gave it."""
    res = JobResources("slipway-probe-train", nodes=2, tasks_per_node=2, gpus_per_node=2, cpus_per_task=1,
                       time_limit_min=5, partition="gpu", signal_delay_s=30)
    rows = _run_rendered(tmp_path, res)
    assert len(rows) == 4
    for node in ("g1", "g2"):
        mine = [r for r in rows if r["SLURMD_NODENAME"] == node]
        assert len(mine) == 2, rows
        assert all(len(r["cpus"]) == 1 for r in mine) and mine[0]["cpus"] != mine[1]["cpus"], mine
        visible = [r["CUDA_VISIBLE_DEVICES"].split(",") for r in mine]
        assert all(len(v) == 2 for v in visible), mine  # the node's two GPUs, as the trainer expects
        own = {v[int(r["SLURM_LOCALID"])] for v, r in zip(visible, mine)}
        assert len(own) == 2, mine  # each rank its own GPU
        assert all(r["SLURM_JOB_GPUS"] and len(r["SLURM_JOB_GPUS"].split(",")) == 2 for r in mine), mine


@pytest.mark.parametrize("exact", [False, True], ids=["whole", "exact"])
def test_training_ranks_with_two_cpus_each(tmp_path, exact):
    """One rank per node asking for both CPUs of its node gets both (an exact step of a script without
    srun's --cpus-per-task gives it one)."""
    res = JobResources("slipway-probe-train2", nodes=2, tasks_per_node=1, cpus_per_task=2, time_limit_min=5,
                       partition="cpu", signal_delay_s=30)
    rows = _run_rendered(tmp_path, res, exact)
    assert len(rows) == 2 and all(len(r["cpus"]) == 2 for r in rows), rows
