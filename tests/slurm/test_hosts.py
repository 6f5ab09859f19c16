"""The devcluster's nodes are hosts of their own (slurm/devcluster_lib/hosts.py), checked from inside real job
steps: each node has its own network namespace, address, host name, /tmp and /dev/shm; the nodes resolve each
other's names to their addresses; the folders a site shares (here: the test suite's, /tmp/pytest-of-<user>,
which the cluster shares as a site shares its scratch) are the same everywhere; nothing outside the cluster's
bridge is reachable; ``link NODE down`` cuts a node off and ``link NODE up`` brings it back; ``up`` refuses in
one line where namespaces are not to be had, and will not switch a running cluster to the single-host mode;
that lenient mode still works.

Needs the devcluster with its nodes as hosts (``slurm/devcluster up``, as ``make test`` starts it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.devcluster import (
    DEVCLUSTER,
    NODES,
    bridge_address,
    devcluster,
    layout,
    net_leftovers,
    node_addresses,
    require_hosts,
    set_link,
    settings,
    slurmd_port,
)
from tests.slurm_cli import slurm

pytestmark = pytest.mark.slurm

# What a step reports of the node it runs on (stdlib only: runs in the job's Python).
PROBE = r"""
import json, os, socket, sys
shared, marker = sys.argv[1], sys.argv[2]
own = "/tmp/" + marker
with open(own, "w") as f:
    f.write(os.environ["SLURMD_NODENAME"])
open("/dev/shm/" + marker, "w").close()
def reach(addr, port, timeout=3):
    try:
        socket.create_connection((addr, port), timeout=timeout).close()
        return "connected"
    except ConnectionRefusedError:
        return "refused"
    except OSError as e:
        return type(e).__name__ + ": " + str(e)
peers = {n: socket.gethostbyname(n) for n in sys.argv[3].split(",")}
print(json.dumps({
    "node": os.environ["SLURMD_NODENAME"], "hostname": socket.gethostname(),
    "netns": os.readlink("/proc/self/ns/net"), "mntns": os.readlink("/proc/self/ns/mnt"),
    "uts": os.readlink("/proc/self/ns/uts"), "resolved": peers,
    "tmp": marker in os.listdir("/tmp"), "shm": marker in os.listdir("/dev/shm"),
    "shared": open(shared).read(),
    "outside": reach(sys.argv[4], 22),
}))
"""


def _steps(tmp_path: Path, *srun_args: str) -> dict[str, dict]:
    """Run PROBE in one task per node; {node: what it saw}."""
    require_hosts()
    marker = f"probe-{uuid.uuid4().hex[:8]}"
    shared = tmp_path / "shared.txt"
    shared.write_text("written on the login node")
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    outside = _this_machines_other_address()
    out = slurm("srun", *srun_args, "-t", "2", sys.executable, str(script), str(shared), marker,
                ",".join(node_addresses()), outside, timeout=120)
    seen = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {s["node"]: {**s, "marker": marker} for s in seen}


def _this_machines_other_address() -> str:
    """An address of this machine outside the cluster's bridge (its own IP on its real interface)."""
    shown = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=30)
    for line in shown.stdout.splitlines():
        words = line.split()
        if words[1] not in ("lo", layout().bridge):
            return words[3].split("/")[0]
    return "127.0.0.1"


def test_every_node_is_a_host_of_its_own(tmp_path):
    seen = _steps(tmp_path, "-p", "spare", "-N3", "-n3")
    addresses = node_addresses()
    assert sorted(seen) == ["n3", "n4", "n5"], seen
    assert len({s["netns"] for s in seen.values()}) == 3  # a network namespace each
    assert len({s["uts"] for s in seen.values()}) == 3 and len({s["mntns"] for s in seen.values()}) == 3
    me = {os.readlink(f"/proc/self/ns/{k}") for k in ("net", "uts", "mnt")}
    assert not me & {s[k] for s in seen.values() for k in ("netns", "uts", "mntns")}  # none is the login's
    for node, s in seen.items():
        assert s["hostname"] == node, s
        assert s["resolved"] == addresses, s  # every node resolves every node to its own address
        assert s["tmp"] and s["shm"], s
        assert s["shared"] == "written on the login node"  # the site's shared folders are shared
        # No route out of the cluster: not even to this machine's own address on its real interface.
        assert "unreachable" in s["outside"].lower(), s
    # /tmp is each node's own (every node wrote the same name, each its own name in it: a shared /tmp would
    # hold one file), kept in the node's folder of the state folder, as on a disk of its own; the login
    # node's /tmp has none of them.
    marker = seen["n3"]["marker"]
    try:
        for node in seen:
            own = layout().node_dir(node) / "tmp" / marker
            assert own.exists() and own.read_text() == node, f"{node} wrote no {marker} into its own /tmp"
        assert not (Path("/tmp") / marker).exists() and not (Path("/dev/shm") / marker).exists()
    finally:
        for node in seen:
            (layout().node_dir(node) / "tmp" / marker).unlink(missing_ok=True)


def test_slurm_reaches_the_nodes_at_their_addresses_and_they_reach_the_controller():
    require_hosts()
    addresses = node_addresses()
    for node in NODES:
        shown = slurm("scontrol", "show", "node", node)
        assert f"NodeAddr={addresses[node]} " in shown and f"NodeHostName={node} " in shown, shown
    conf = layout().slurm_conf.read_text()
    assert f"SlurmctldHost={_hostname()}({bridge_address()})" in conf
    assert f"AccountingStorageHost={bridge_address()}" in conf
    # From inside a node: the controller (squeue) and accounting (sacct, which fails when slurmdbd does not
    # answer) answer through the bridge.
    out = slurm("srun", "-N1", "-w", "n2", "-t", "1", "bash", "-c",
                "squeue -h -j $SLURM_JOB_ID -o %N && sacct -n -X -S now-1hours -o JobID >/dev/null && "
                "echo accounting-answered", timeout=120)
    assert out.split() == ["n2", "accounting-answered"], out


def _hostname() -> str:
    import socket

    return socket.gethostname().split(".")[0]


def test_a_node_whose_link_is_down_is_cut_off_until_it_is_up_again(tmp_path):
    """``link n2 down`` drops n2's traffic silently (a pulled cable: a connect times out, no refusal)."""
    require_hosts()
    n2 = node_addresses()["n2"]
    port = slurmd_port("n2")
    probe = ("import socket, sys\ntry:\n"
             "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()\n"
             "    print('reached')\nexcept OSError as e:\n    print('cut', type(e).__name__)\n")
    script = tmp_path / "reach.py"
    script.write_text(probe)

    def from_n1() -> str:
        return slurm("srun", "-N1", "-w", "n1", "-t", "1", sys.executable, str(script), n2, str(port),
                     timeout=120).strip()

    assert from_n1() == "reached"
    set_link("n2", up=False)
    try:
        assert from_n1() == "cut TimeoutError"
    finally:
        set_link("n2", up=True)
    assert from_n1() == "reached"


def test_up_refuses_in_one_line_where_namespaces_are_unavailable():
    """An unprivileged user cannot make namespaces and a bridge: up says so in one line, and how to go on."""
    if shutil.which("setpriv") is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv (util-linux) to run up as an unprivileged user")
    with tempfile.TemporaryDirectory(prefix="devcluster-unprivileged-") as where:  # one nobody may write
        os.chmod(where, 0o777)
        res = _up_as_nobody(Path(where) / "state")
    assert res.returncode == 1, res.stdout + res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("devcluster up: the nodes cannot be separate hosts here: not root") and \
        "--single-host" in lines[0], lines


def _up_as_nobody(state: Path) -> subprocess.CompletedProcess:
    """The system's python3 runs the entry point (it needs no more: standard library only)."""
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(DEVCLUSTER),
                           "--dir", str(state), "up"], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"})


def test_a_running_cluster_of_hosts_is_not_switched_to_a_single_host():
    require_hosts()
    res = devcluster("up", "--single-host", timeout=120)
    assert res.returncode == 1 and len(res.stderr.splitlines()) == 1, res.stderr
    assert "this cluster runs as hosts" in res.stderr and "down" in res.stderr, res.stderr
    assert settings().hosts


def test_the_single_host_mode_still_runs_jobs_on_this_host(tmp_path):
    """The lenient option (``up --single-host``): every node is this host, in its namespaces, with its
    /tmp; a cluster of it comes up beside the suite's and goes down leaving no namespace or link."""
    state = tmp_path / "lenient"
    try:
        res = devcluster("up", "--single-host", root=state, timeout=240)
        assert res.returncode == 0, res.stdout + res.stderr
        env = dict(os.environ, SLURM_CONF=str(state / "etc" / "slurm.conf"))
        out = subprocess.run(["srun", "-N2", "-n2", "-t", "1", "bash", "-c",
                              "echo $SLURMD_NODENAME $(hostname) $(readlink /proc/self/ns/net)"], env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        rows = sorted(line.split() for line in out.stdout.splitlines())
        me = [_hostname(), os.readlink("/proc/self/ns/net")]
        assert rows == [["n1", *me], ["n2", *me]], rows
        assert "single host: every node is this machine" in devcluster("status", root=state).stdout
    finally:
        down = devcluster("down", root=state, timeout=120)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not net_leftovers(state)
