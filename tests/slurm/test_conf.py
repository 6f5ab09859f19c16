"""The devcluster's configuration for either kind of machine (pure: no cluster is started). With cgroup v1
usable, jobs are confined by task/cgroup and tracked by proctrack/cgroup; without (a container that mounts
the cgroup tree read-only, cgroup v2 alone), binding is task/affinity's alone and slurm.conf says why. The
machine this suite runs on takes one of the two; this test covers the other as well.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "slurm"))
from devcluster_lib import conf  # noqa: E402
from devcluster_lib.layout import NODE_SPECS, Layout, Settings  # noqa: E402
from devcluster_lib.machine import Machine  # noqa: E402

READ_ONLY = "cannot create a cgroup in /sys/fs/cgroup/memory (Read-only file system)"


@pytest.mark.parametrize("problem", [None, READ_ONLY])
def test_binding_follows_what_the_machine_allows(tmp_path, problem):
    layout = Layout(tmp_path / "state")
    layout.make_dirs()
    machine = Machine(sockets=1, cores_per_socket=2, threads_per_core=1, memory_mb=4096,
                      cgroup_problem=problem)
    settings = Settings(port_base=17100, db_password="x", subnet="198.18.0.16/28")
    conf.write_all(layout, settings, "host", machine)
    text = layout.slurm_conf.read_text()
    assert "TaskPluginParam=autobind=cores" in text and "SelectTypeParameters=CR_Core_Memory" in text
    if problem is None:
        assert "TaskPlugin=task/cgroup,task/affinity" in text and "ProctrackType=proctrack/cgroup" in text
        assert "ConstrainRAMSpace=yes" in (layout.etc / "cgroup.conf").read_text()
    else:
        assert "TaskPlugin=task/affinity\n" in text and "ProctrackType=proctrack/linuxproc" in text
        assert f"# cgroups not used: {problem}" in text and not (layout.etc / "cgroup.conf").exists()
    # Every node is the machine (the CPU ids a task is bound to exist); the gpu nodes carry gres/gpu.
    for node in NODE_SPECS:
        line = next(x for x in text.splitlines() if x.startswith(f"NodeName={node.name} "))
        assert "CPUs=2 " in line and "RealMemory=4096" in line
        assert (f"Gres=gpu:{node.gpus}" in line) == bool(node.gpus)
    gres = (layout.etc / "gres.conf").read_text()
    assert gres.count("Name=gpu File=") == sum(n.gpus for n in NODE_SPECS)
    first, last = conf.job_ids(settings)
    assert f"FirstJobId={first}" in text and last - first + 1 == conf.JOB_ID_BLOCK


def test_pyxis_is_loaded_where_installed_with_enroot_folders_per_node(tmp_path, monkeypatch):
    """Without pyxis the plugstack loads nothing (the host's plugins stay out); with it installed, one line
    loads it, and enroot gets one set of folders per node (two nodes of a step share this machine)."""
    from devcluster_lib import pyxis

    layout = Layout(tmp_path / "state")
    layout.make_dirs()
    machine = Machine(sockets=1, cores_per_socket=2, threads_per_core=1, memory_mb=4096, cgroup_problem=None)
    settings = Settings(port_base=17100, db_password="x", subnet="198.18.0.16/28")
    plugin, enroot = tmp_path / "spank_pyxis.so", tmp_path / "bin" / "enroot"
    monkeypatch.setattr(pyxis, "PLUGINS", (plugin,))
    monkeypatch.setattr(pyxis, "ENROOTS", (enroot,))
    assert pyxis.find() is None and "not installed" in pyxis.describe(None)
    conf.write_all(layout, settings, "host", machine, pyxis.plugstack(layout, None))
    lines = (layout.etc / "plugstack.conf").read_text().splitlines()
    assert [x for x in lines if not x.startswith("#")] == []
    plugin.write_bytes(b"")
    enroot.parent.mkdir()
    enroot.write_text('config::export ENROOT_SYSCONF_PATH     "/usr/local/etc/enroot"\n')
    found = pyxis.find()
    assert found == pyxis.Pyxis(plugin, enroot, Path("/usr/local/etc/enroot"))
    assert conf.write_all(layout, settings, "host", machine, pyxis.plugstack(layout, found))
    assert f"required {plugin} runtime_path={layout.root / 'pyxis'} container_scope=job" in \
        (layout.etc / "plugstack.conf").read_text()
    folders = pyxis.enroot_folders(layout)
    assert f"ENROOT_DATA_PATH {layout.root}/enroot/data/${{SLURMD_NODENAME:-login}}\n" in folders


def test_down_removes_only_its_own_enroot_drop_in(tmp_path, monkeypatch):
    """enroot's configuration is the host's: after ``down`` it must not keep pointing into a state folder
    that may be deleted, and a drop-in another cluster's ``up`` wrote last is not this one's to remove."""
    from devcluster_lib import pyxis

    sysconf, enroot = tmp_path / "etc" / "enroot", tmp_path / "bin" / "enroot"
    enroot.parent.mkdir()
    enroot.write_text(f'config::export ENROOT_SYSCONF_PATH "{sysconf}"\n')
    monkeypatch.setattr(pyxis, "ENROOTS", (enroot,))
    ours, theirs = Layout(tmp_path / "ours"), Layout(tmp_path / "theirs")
    path = pyxis.drop_in(sysconf)
    assert pyxis.release(ours) is None  # nothing written yet: nothing to remove, no error
    path.parent.mkdir(parents=True)
    path.write_text(pyxis.enroot_folders(theirs))
    assert pyxis.release(ours) is None and path.read_text() == pyxis.enroot_folders(theirs)
    path.write_text(pyxis.enroot_folders(ours))
    assert pyxis.release(ours) == path and not path.exists()


def test_the_daemons_ports_stay_below_every_jobs_master_port():
    """A job's rendezvous port never lands on a daemon of the devcluster (they share one host's ports)."""
    from devcluster_lib.layout import PORT_RANGE, PORT_STEP

    from trainer.formulas import PORT_BASE

    assert PORT_RANGE[1] + PORT_STEP <= PORT_BASE, (PORT_RANGE, PORT_STEP, PORT_BASE)


def test_every_slurmd_has_a_port_of_the_clusters_block_and_an_address_of_its_range():
    """Each node's slurmd port lies in the cluster's block of PORT_STEP ports (single host: they share this
    host's ports), and each node's address in its /28 (nodes as hosts), the bridge's first."""
    import ipaddress

    from devcluster_lib import hosts
    from devcluster_lib.layout import NET_PREFIX, NODES, PORT_STEP, SLURMD0

    assert SLURMD0 + len(NODES) <= PORT_STEP, (SLURMD0, NODES, PORT_STEP)
    net = ipaddress.ip_network("198.18.0.16/28")
    assert 2 + len(NODES) <= net.num_addresses - 1 and net.prefixlen == NET_PREFIX  # network, bridge, nodes
    addresses = hosts.node_addresses(str(net))
    assert hosts.bridge_address(str(net)) == "198.18.0.17" and addresses["n1"] == "198.18.0.18"
    assert len(set(addresses.values())) == len(NODES) and all(ipaddress.ip_address(a) in net
                                                                for a in addresses.values())


@pytest.mark.parametrize("mode", ["hosts", "single-host"])
def test_nodes_are_reached_at_their_own_addresses_or_all_at_loopback(tmp_path, mode):
    """Nodes as hosts: each node's NodeAddr is its address, NodeHostname its name, slurmctld and accounting
    at the bridge's address (which the nodes reach), no NoInAddrAny (srun on this host must take the
    nodes' connections on the bridge), the node's own /tmp. Single host: 127.0.0.1 and loopback only."""
    from devcluster_lib import hosts

    layout = Layout(tmp_path / "state")
    settings = Settings(port_base=17100, db_password="x", subnet="198.18.0.16/28", mode=mode)
    text = conf.slurm_conf(layout, settings, "login", Machine(1, 2, 1, 4096, None))
    lines = {x.split("=", 1)[0]: x for x in text.splitlines() if "=" in x and not x.startswith("Node")}
    n3 = next(x for x in text.splitlines() if x.startswith("NodeName=n3 "))
    if mode == "hosts":
        ctl = hosts.bridge_address(settings.subnet)
        assert f"NodeHostname=n3 NodeAddr={hosts.node_addresses(settings.subnet)['n3']} " in n3
        assert "CommunicationParameters" not in lines and lines["TmpFS"] == "TmpFS=/tmp"
    else:
        ctl = "127.0.0.1"
        assert "NodeHostname=login NodeAddr=127.0.0.1 " in n3
        assert lines["CommunicationParameters"].endswith("NoCtldInAddrAny,NoInAddrAny")
    assert lines["SlurmctldHost"] == f"SlurmctldHost=login({ctl})"
    assert lines["AccountingStorageHost"] == f"AccountingStorageHost={ctl}"
    assert "PartitionName=spare Nodes=n3,n4,n5 Default=NO" in text  # the spare node's partition, its own


def test_the_subnet_is_one_this_machine_does_not_use_and_differs_by_state_folder():
    import ipaddress

    from devcluster_lib import hosts

    first = hosts.pick_subnet(Path("/a/.devcluster"), used=[])
    assert ipaddress.ip_network(first).subnet_of(ipaddress.ip_network("198.18.0.0/15"))
    taken = [ipaddress.ip_network(first), ipaddress.ip_network("10.0.0.0/8")]
    second = hosts.pick_subnet(Path("/a/.devcluster"), used=taken)  # the same folder, its first choice taken
    assert second != first and not ipaddress.ip_network(second).overlaps(taken[0])
    assert hosts.pick_subnet(Path("/b/.devcluster"), used=[]) != first  # another folder starts elsewhere


def test_a_node_keeps_its_own_tmp_but_binds_back_the_shared_folders_under_it(tmp_path):
    """The node's /tmp and /var/tmp are its folders; a state folder under /tmp (and the suite's folder)
    are bound back from the machine's /tmp through the working directory (no path canonicalisation)."""
    from devcluster_lib import hosts

    inside = hosts.node_script(Layout(Path("/tmp/x/state")), "n2")
    assert "hostname n2" in inside and "mount --bind /tmp/x/state/nodes/n2/tmp /tmp" in inside
    assert "mkdir -p /tmp/x/state && mount --no-canonicalize --bind ./x/state /tmp/x/state" in inside
    assert "mount --no-canonicalize --bind ./pytest-of-" in inside  # the suite's runs: shared
    assert "mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm" in inside
    assert "mount --bind /tmp/x/state/etc/hosts /etc/hosts" in inside and inside.endswith('exec "$@"')
    outside = hosts.node_script(Layout(Path("/srv/state")), "n2")
    assert "./srv" not in outside and "mount --bind /srv/state/nodes/n2/var-tmp /var/tmp" in outside


def test_a_checkout_under_tmp_is_shared_with_the_nodes_once(monkeypatch):
    """CI clones the repository under /tmp: its .venv is what every job step executes, so the nodes bind it
    back (a node without it fails each job with 'execve(): .../.venv/bin/python: No such file'); a state
    folder inside the checkout needs no bind of its own."""
    from devcluster_lib import hosts

    monkeypatch.setattr(hosts, "REPO", Path("/tmp/ci"))
    inside = hosts.node_script(Layout(Path("/tmp/ci/.devcluster")), "n1")
    assert "mkdir -p /tmp/ci && mount --no-canonicalize --bind ./ci /tmp/ci" in inside
    assert "./ci/.devcluster" not in inside
    monkeypatch.setattr(hosts, "REPO", Path("/srv/slipway"))  # a checkout outside /tmp: nothing to bind
    assert "./ci" not in hosts.node_script(Layout(Path("/srv/slipway/.devcluster")), "n1")
