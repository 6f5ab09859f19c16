"""The devcluster is a real two-node Slurm cluster: srun, submitit + torch.distributed (gloo) and sacct work,
and the `slurm/devcluster` CLI reports status, is idempotent, and `down` stops exactly its own processes.

Needs a running devcluster (`eval "$(slurm/devcluster up)"`); `make test` brings one up around the suite.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.devcluster import NODES, Layout, load_settings
from tests.slurm_cli import sacct_final_state, sacct_states
from tests.waits import JOB_S
from trainer.formulas import master_port

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
DEVCLUSTER = REPO / "slurm" / "devcluster"
DAEMONS = ("munged", "mariadbd", "slurmdbd", "slurmctld", *(f"slurmd-{n}" for n in NODES))


@pytest.fixture(scope="module")
def state_dir() -> Path:
    """The state folder of the cluster SLURM_CONF points at (<dir>/etc/slurm.conf)."""
    return Path(os.environ["SLURM_CONF"]).resolve().parents[1]


def devcluster(state_dir: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(DEVCLUSTER), "--dir", str(state_dir), *args], capture_output=True, text=True,
                          timeout=timeout)


def daemon_pids(state_dir: Path) -> dict[str, int]:
    return {p.stem: int(p.read_text().split()[0]) for p in (state_dir / "pids").glob("*.pid")}


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_status_reports_every_daemon_and_idle_nodes(state_dir):
    res = devcluster(state_dir, "status")
    assert res.returncode == 0, res.stdout + res.stderr
    for name in DAEMONS:
        assert f"{name} " in res.stdout, res.stdout
    assert "stopped" not in res.stdout, res.stdout
    assert "n1=" in res.stdout and "n2=" in res.stdout


def test_up_again_is_a_fast_no_op(state_dir):
    before = daemon_pids(state_dir)
    assert set(before) == set(DAEMONS)
    res = devcluster(state_dir, "up", timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    # Every line but the last is a shell comment, so `eval "$(slurm/devcluster up)"` works.
    assert lines[-1] == f"export SLURM_CONF={os.environ['SLURM_CONF']}"
    assert all(line.startswith("#") for line in lines[:-1]), lines
    assert "already up" in res.stdout
    assert daemon_pids(state_dir) == before  # nothing was restarted


def test_env_prints_the_export_line(state_dir):
    res = devcluster(state_dir, "env")
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"export SLURM_CONF={os.environ['SLURM_CONF']}\n"


def test_srun_runs_one_task_on_each_node_and_sacct_records_it():
    name = f"srun-{uuid.uuid4().hex[:8]}"
    res = subprocess.run(["srun", "-N2", "-n2", f"--job-name={name}", "-t", "2", "bash", "-c",
                          "echo $SLURM_JOB_ID $SLURMD_NODENAME $SLURM_PROCID"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    rows = sorted(line.split() for line in res.stdout.splitlines())
    assert [r[1:] for r in rows] == [["n1", "0"], ["n2", "1"]], res.stdout
    job_ids = {r[0] for r in rows}
    assert len(job_ids) == 1
    assert sacct_final_state(job_ids.pop()) == "COMPLETED"


def test_submitit_two_nodes_two_tasks_allreduce_with_gloo(tmp_path):
    import submitit  # a hard dependency of Slipway: missing, it is an error, never a skip

    from tests.slurm._jobs import allreduce_rank

    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm",
                                     slurm_python=sys.executable)
    executor.update_parameters(
        nodes=2, tasks_per_node=2, cpus_per_task=1, mem_gb=2, timeout_min=5, name="allreduce",
        # The job imports tests.slurm._jobs; one thread per rank since the 4 ranks share this box's cores.
        slurm_setup=[f"export PYTHONPATH={REPO}:${{PYTHONPATH:-}}", "export OMP_NUM_THREADS=1"],
    )
    job = executor.submit(allreduce_rank)
    results = job.results()
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    assert all(r["world_size"] == 4 and r["sum"] == 1 + 2 + 3 + 4 for r in results), results
    placement = sorted((r["node"], r["local_rank"]) for r in results)
    assert placement == [("n1", 0), ("n1", 1), ("n2", 0), ("n2", 1)]
    assert {r["master_addr"] for r in results} == {"n1"}
    assert {r["master_port"] for r in results} == {master_port(int(job.job_id))}
    assert sacct_final_state(job.job_id) == "COMPLETED"


def test_second_cluster_starts_from_nothing_and_down_stops_only_its_own(tmp_path, state_dir):
    """A fresh state folder (deep enough that its sockets must move to /tmp) beside the running cluster:
    its own ports, address range, bridge and namespaces; its `down` removes exactly those."""
    other = tmp_path / ("deep" * 20) / "state"
    main_pids = daemon_pids(state_dir)
    main_net = cluster_net(Layout(state_dir))
    try:
        res = devcluster(other, "up", timeout=240)
        assert res.returncode == 0, res.stdout + res.stderr
        conf = other / "etc" / "slurm.conf"
        assert res.stdout.splitlines()[-1] == f"export SLURM_CONF={conf}"
        env = dict(os.environ, SLURM_CONF=str(conf))
        out = subprocess.run(["srun", "-N2", "-n2", "-t", "1", "bash", "-c",
                              "echo $SLURMD_NODENAME $(hostname -i) $(readlink /proc/self/ns/net)"], env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        other_pids = daemon_pids(other)
        assert set(other_pids) == set(DAEMONS) and not set(other_pids.values()) & set(main_pids.values())
        theirs, ours = load_settings(Layout(other)), load_settings(Layout(state_dir))
        if ours.hosts:
            other_net = cluster_net(Layout(other))
            assert not other_net & main_net and len(other_net) == len(main_net)  # links and namespaces
            net = ipaddress.ip_network(theirs.subnet)
            assert not net.overlaps(ipaddress.ip_network(ours.subnet)), (theirs.subnet, ours.subnet)
            rows = sorted(line.split() for line in out.stdout.splitlines())
            assert [r[0] for r in rows] == ["n1", "n2"], out.stdout
            assert all(ipaddress.ip_address(r[1]) in net for r in rows), (rows, net)  # the second's nodes
    finally:
        down = devcluster(other, "down", timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not any(alive(p) for p in other_pids.values())
    assert not list((other / "pids").glob("*.pid"))
    assert all(alive(p) for p in main_pids.values())  # the main cluster was not touched
    if ours.hosts:
        assert not cluster_net(Layout(other)), cluster_net(Layout(other))  # every namespace and link gone
        assert cluster_net(Layout(state_dir)) == main_net  # the main cluster's all there
    assert devcluster(state_dir, "status").returncode == 0


def cluster_net(layout: Layout) -> set[str]:
    """The cluster's network namespaces (``ip netns``) and links (``ip link``) that exist now."""
    netns = {line.split()[0] for line in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                         text=True, timeout=30).stdout.splitlines() if line}
    links = {line.split(":")[1].strip().split("@")[0] for line in subprocess.run(
        ["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout.splitlines()}
    return {f"netns {n}" for n in netns if n.startswith(layout.tag)} | \
        {f"link {x}" for x in links if x.startswith(layout.tag)}


SIGNAL_THEN_REQUEUE = """
n=${SLURM_RESTART_COUNT:-0}
trap 'echo "signal USR2 restarts=$n" >> {log}; scontrol requeue $SLURM_JOB_ID; exit 0' USR2
echo "start restarts=$n" >> {log}
[ "$n" -ge 1 ] && exit 0
sleep 300 & wait
"""


def test_signal_then_requeue_from_inside_the_job(tmp_path):
    """The submitit/trainer pattern: --signal reaches the job, which requeues itself; the rerun completes."""
    log = tmp_path / "events.log"
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n" + SIGNAL_THEN_REQUEUE.replace("{log}", str(log)))
    # Time limit 1 min, signal 30 s before: slurmctld checks every 30 s, so it arrives within ~30 s.
    res = subprocess.run(["sbatch", "--parsable", "-N1", "-t", "1", "--signal=B:USR2@30", "--requeue",
                          "-o", str(tmp_path / "slurm-%j.out"), str(script)], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    job_id = res.stdout.strip().split(";")[0]
    state = sacct_final_state(job_id, timeout=JOB_S)
    assert state == "COMPLETED", (tmp_path / f"slurm-{job_id}.out").read_text()
    assert log.read_text().splitlines() == ["start restarts=0", "signal USR2 restarts=0", "start restarts=1"]
    requeued = sacct_states(job_id, duplicates=True)
    assert requeued[0] == "REQUEUED" and requeued[-1] == "COMPLETED", requeued
