"""The plan refuses a job no node of its partition can hold, from sinfo, before anything is submitted
(orchestrator/world/sinfo.py, checks/slurm.py partition_problems): more GPUs, CPUs or memory per node than a
node has (a stage job's memory included), more nodes than can hold it, a partition Slurm does not have, a
time limit longer than the partition's MaxTime. Without it sbatch refuses the training job half-way
through the launch (its corpus and preprocessing jobs already queued), or Slurm leaves it pending where
the big nodes exist but are down, or past the partition's time limit (PartitionTimeLimit).

The rules run against a stand-in sinfo (a site's table); the refusal runs against the devcluster's own.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from orchestrator.base.plan_types import Context
from orchestrator.base.problems import PlanError
from orchestrator.checks.slurm import partition_problems
from orchestrator.world.sinfo import gpus_of, parse, time_limit_min
from tests.orchestrator.conftest import compose_cfg
from tests.orchestrator.devcluster_helpers import my_jobs

SITE = """cpu*|c1|64|256000|(null)|infinite
cpu*|c2|64|256000|(null)|infinite
gpu|g1|32|512000|gpu:a100:4(S:0-1)|1-00:00:00
gpu|g2|32|512000|gpu:a100:4(S:0-1)|1-00:00:00
gpu|g3|32|512000|gpu:a100:8(S:0-1),nvme:1|1-00:00:00
"""


def _sinfo(tmp_path: Path, monkeypatch, table: str = SITE) -> None:
    fake = tmp_path / "bin" / "sinfo"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text(f"#!/bin/bash\ncat <<'EOF'\n{table}EOF\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")


def _problems(*overrides: str) -> dict[str, object]:
    if not any(o.startswith("cluster.cpus_per_task=") for o in overrides):
        overrides = (*overrides, "cluster.cpus_per_task=4")  # slurm.yaml's 12 x 8 tasks: more than a node
    cfg = compose_cfg(["+experiment=codeparrot_smoke", "cluster=slurm", *overrides])
    return {p.code: p for p in partition_problems(Context(cfg))}


def test_sinfo_table():
    parts = parse(SITE)
    assert parts["cpu"].default and not parts["gpu"].default
    assert (parts["gpu"].max_gpus, parts["gpu"].max_cpus, parts["cpu"].max_memory_mb) == (8, 32, 256000)
    assert (parts["gpu"].max_time_min, parts["cpu"].max_time_min) == (1440, None)


def test_slurm_time_limits_as_sinfo_prints_them():
    """%l as sinfo 22.05 printed it on the devcluster for MaxTime=30, 90, 1440, 2-12:30:00 and UNLIMITED."""
    printed = {"30:00": 30, "1:30:00": 90, "1-00:00:00": 1440, "2-12:30:00": 3630, "infinite": None}
    assert {text: time_limit_min(text) for text in printed} == printed
    assert [gpus_of(g) for g in ("gpu:2", "(null)", "gpu:a100:2,gpu:v100:2", "gpu:h100:8(S:0-1),nvme:1")] == [
        2, 0, 4, 8]


def test_a_job_the_nodes_can_hold_passes(tmp_path, monkeypatch):
    _sinfo(tmp_path, monkeypatch)
    assert _problems("cluster.partition=gpu", "cluster.gpus_per_node=4", "cluster.nodes=3") == {}


@pytest.mark.parametrize("overrides,code,key", [
    (["cluster.partition=gpu", "cluster.gpus_per_node=16"], "partition_gpus", "cluster.gpus_per_node"),
    (["cluster.partition=cpu", "cluster.gpus_per_node=1"], "partition_gpus", "cluster.gpus_per_node"),
    (["cluster.partition=gpu", "cluster.gpus_per_node=8", "cluster.nodes=2"], "partition_nodes",
     "cluster.nodes"),
    (["cluster.partition=gpu", "cluster.gpus_per_node=4", "cluster.cpus_per_task=16"], "partition_cpus",
     "cluster.cpus_per_task"),
    (["cluster.partition=gpu", "cluster.gpus_per_node=4", "cluster.mem_gb=1000"], "partition_memory",
     "cluster.mem_gb"),
    (["cluster.partition=h100"], "partition_unknown", "cluster.partition"),
    (["cluster.partition=gpu", "cluster.gpus_per_node=4", "cluster.stage_partition=cpu",
      "cluster.stage_cpus=128"], "partition_cpus", "cluster.stage_cpus"),
    (["cluster.partition=gpu", "cluster.gpus_per_node=4", "cluster.stage_partition=cpu",
      "cluster.stage_mem_gb=300"], "partition_memory", "cluster.stage_mem_gb"),
    (["cluster.partition=gpu", "cluster.gpus_per_node=4", "cluster.stage_partition=cpu", "data.workers=600"],
     "partition_memory", "cluster.stage_mem_gb"),  # preprocessing's own figure: 2 + 0.5 GB per worker
    (["cluster.partition=gpu", "cluster.gpus_per_node=4", "cluster.time_limit_min=2880"], "time_limit",
     "cluster.time_limit_min"),
    (["cluster.partition=gpu", "cluster.gpus_per_node=4", "cluster.stage_time_limit_min=1441"], "time_limit",
     "cluster.stage_time_limit_min"),  # the stage jobs run on the training partition when none is named
])
def test_a_job_no_node_can_hold_is_refused(tmp_path, monkeypatch, overrides, code, key):
    _sinfo(tmp_path, monkeypatch)
    problems = _problems(*overrides)
    assert code in problems and problems[code].key == key and problems[code].fix, problems


def test_a_time_limit_over_maxtime_names_the_partitions_limit(tmp_path, monkeypatch):
    _sinfo(tmp_path, monkeypatch)
    p = _problems("cluster.partition=gpu", "cluster.gpus_per_node=4", "cluster.time_limit_min=2880",
                  "cluster.stage_partition=cpu", "cluster.stage_time_limit_min=100000")["time_limit"]
    assert str(p) == ("[time_limit] cluster.time_limit_min=2880: exceeds partition gpu's MaxTime 1440 min "
                      "(sinfo): Slurm would refuse the job or leave it pending. Fix: set "
                      "cluster.time_limit_min<=1440 or pick a partition with a longer limit"), str(p)
    assert _problems("cluster.partition=gpu", "cluster.gpus_per_node=4", "cluster.time_limit_min=1440",
                     "cluster.stage_partition=cpu", "cluster.stage_time_limit_min=100000") == {}


def test_no_slurm_here_no_problem(tmp_path, monkeypatch):
    """A dry run on a laptop: sinfo is missing (or fails), so there is nothing to check against."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert _problems("cluster.partition=gpu", "cluster.gpus_per_node=64") == {}
    _sinfo(tmp_path, monkeypatch, table="")
    failing = "#!/bin/bash\necho 'slurm_load_partitions: Zero Bytes' >&2\nexit 1\n"
    (tmp_path / "bin" / "sinfo").write_text(failing)
    assert _problems("cluster.partition=gpu", "cluster.gpus_per_node=64") == {}


@pytest.mark.slurm
def test_the_devcluster_refuses_more_gpus_per_node_than_its_nodes_have(tmp_path):
    """4 GPUs per node on the gpu partition, whose nodes have 2: refused at plan time, nothing queued."""
    from orchestrator.launch.flow import launch

    before = set(my_jobs())
    cfg = compose_cfg(["+experiment=codeparrot_smoke", "cluster=devcluster", "cluster.partition=gpu",
                       "cluster.gpus_per_node=4", "cluster.tasks_per_node=2", f"runs_root={tmp_path}/runs",
                       f"cache_dir={tmp_path}/cache"])
    with pytest.raises(PlanError) as err:
        launch(cfg, out=io.StringIO())
    [p] = [p for p in err.value.problems if p.code == "partition_gpus"]
    assert p.key == "cluster.gpus_per_node" and "at most 2 GPUs" in p.message
    assert not set(my_jobs()) - before and not (tmp_path / "runs").exists()


@pytest.mark.slurm
def test_the_devcluster_refuses_a_time_limit_over_its_partitions_maxtime(tmp_path):
    """The devcluster's cpu partition has MaxTime=1-00:00:00 (slurm/devcluster_lib/conf.py): a 25-hour
    training job is refused at plan time with sinfo's limit, nothing queued; 24 hours pass."""
    from orchestrator.launch.flow import launch

    before = set(my_jobs())
    args = ["+experiment=codeparrot_smoke", "cluster=devcluster", f"runs_root={tmp_path}/runs",
            f"cache_dir={tmp_path}/cache"]
    with pytest.raises(PlanError) as err:
        launch(compose_cfg([*args, "cluster.time_limit_min=1500"]), out=io.StringIO())
    [p] = [p for p in err.value.problems if p.code == "time_limit"]
    assert p.key == "cluster.time_limit_min" and "partition cpu's MaxTime 1440 min" in p.message, p
    assert not set(my_jobs()) - before and not (tmp_path / "runs").exists()
    assert not partition_problems(Context(compose_cfg([*args, "cluster.time_limit_min=1440"])))
