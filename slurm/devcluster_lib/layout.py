"""Where everything of one devcluster lives, and the few settings chosen once at first ``up``.

Everything (configs, keys, databases, spools, logs, pid files, the nodes' own /tmp) sits under one state
folder so that ``rm -rf`` of it after ``down`` forgets the cluster completely, and several clusters (one
per checkout) can coexist on one machine: ports and the nodes' address range are derived from the
folder's path and persisted, and the network namespaces and links are named by a hash of it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Node:
    """One slurmd of the cluster: its name, its partition and the GPUs (gres/gpu) it declares."""

    name: str
    partition: str
    gpus: int = 0


# Partitions, as on a real site: "cpu" (the default: CPU stages and the gloo training of the tests) and
# "gpu", whose nodes carry gres/gpu on device files the cluster makes (no CUDA: Slurm counts, assigns and
# exports them); "spare", three CPU nodes of their own, where a two-node job has a node to move to when one
# of its nodes fails (the network fault tests cut a node off there without touching the others' jobs).
CPU_PARTITION, GPU_PARTITION, SPARE_PARTITION = "cpu", "gpu", "spare"
GPUS_PER_GPU_NODE = 2
NODE_SPECS = (Node("n1", CPU_PARTITION), Node("n2", CPU_PARTITION),
              Node("g1", GPU_PARTITION, GPUS_PER_GPU_NODE), Node("g2", GPU_PARTITION, GPUS_PER_GPU_NODE),
              Node("n3", SPARE_PARTITION), Node("n4", SPARE_PARTITION), Node("n5", SPARE_PARTITION))
NODES = tuple(n.name for n in NODE_SPECS)
# Partition -> its nodes; the default partition first.
PARTITIONS = {p: tuple(n.name for n in NODE_SPECS if n.partition == p)
              for p in (CPU_PARTITION, GPU_PARTITION, SPARE_PARTITION)}
CLUSTER_NAME = "devcluster"
# Ports live below 20000: jobs' MASTER_PORT starts there (trainer.formulas.master_port; submitit's own pick
# would be in [20000, 60000]) and the kernel's ephemeral range starts at 32768, so neither can collide
# with a daemon of ours.
PORT_RANGE = (17000, 19990)
PORT_STEP = 10
# Offsets from the port base: slurmctld, slurmdbd, MariaDB, then one slurmd per node (PORT_STEP holds them:
# 3 + 7 nodes = 10).
CTLD, DBD, MYSQL, SLURMD0 = 0, 1, 2, 3
# The nodes' addresses: one /28 per cluster out of 198.18.0.0/15, the range RFC 2544 sets aside for
# testing (no real network uses it). The cluster's bridge takes the first address, the nodes the next ones.
NET_RANGE = "198.18.0.0/15"
NET_PREFIX = 28
HOSTS, SINGLE_HOST = "hosts", "single-host"  # the modes: every node its own host, or all nodes this host
# AF_UNIX paths are limited to 108 bytes. slurmstepd puts sockets named <node>_<job>.<step> (up to ~25
# bytes) in the spool folder, so state folders longer than this keep sockets and spools in /tmp instead.
MAX_ROOT_FOR_SOCKETS = 60


@dataclass(frozen=True)
class Settings:
    """Chosen once at first ``up`` and persisted in ``state.json``."""

    port_base: int  # first of PORT_STEP consecutive ports owned by this cluster
    db_password: str  # MariaDB password of the 'slurm' user (loopback only, file mode 0600)
    subnet: str = ""  # the nodes' /28 in NET_RANGE (empty in a state.json written before there was one)
    mode: str = HOSTS  # HOSTS: each node in its own namespaces; SINGLE_HOST: all nodes share this host

    def __post_init__(self) -> None:
        lo, hi = PORT_RANGE
        if not lo <= self.port_base <= hi:
            raise ValueError(f"state.json: port_base={self.port_base} outside {PORT_RANGE}; "
                             "delete the state folder after `devcluster down` to pick again")
        if self.mode not in (HOSTS, SINGLE_HOST):
            raise ValueError(f"state.json: mode={self.mode!r}, expected {HOSTS!r} or {SINGLE_HOST!r}")
        if self.subnet and not ipaddress.ip_network(self.subnet).subnet_of(ipaddress.ip_network(NET_RANGE)):
            raise ValueError(f"state.json: subnet={self.subnet} outside {NET_RANGE}; delete the state "
                             "folder after `devcluster down` to pick again")

    @property
    def hosts(self) -> bool:
        return self.mode == HOSTS

    def port(self, offset: int) -> int:
        return self.port_base + offset


@dataclass(frozen=True)
class Layout:
    """Paths of one cluster's state folder (``root`` is absolute)."""

    root: Path

    def __post_init__(self) -> None:
        if not self.root.is_absolute():
            raise ValueError(f"Layout.root must be absolute, got {self.root}")

    # --- configuration -------------------------------------------------------------------------------
    @property
    def etc(self) -> Path:
        return self.root / "etc"

    @property
    def slurm_conf(self) -> Path:
        return self.etc / "slurm.conf"

    @property
    def slurmdbd_conf(self) -> Path:
        # slurmdbd has no -f flag: it reads slurmdbd.conf beside $SLURM_CONF.
        return self.etc / "slurmdbd.conf"

    @property
    def state_json(self) -> Path:
        return self.root / "state.json"

    # --- runtime ---------------------------------------------------------------------------------------
    @property
    def log(self) -> Path:
        return self.root / "log"

    @property
    def pids(self) -> Path:
        return self.root / "pids"

    @property
    def run(self) -> Path:
        """Pid files the daemons write themselves (ours are in ``pids``)."""
        return self.root / "run"

    @property
    def short(self) -> Path:
        """Parent of everything holding unix sockets: the state folder, or /tmp/devcluster-<hash> if long."""
        if len(str(self.root)) <= MAX_ROOT_FOR_SOCKETS:
            return self.root
        return Path("/tmp") / f"devcluster-{hashlib.sha256(str(self.root).encode()).hexdigest()[:12]}"

    @property
    def sock(self) -> Path:
        return self.short / "sock"

    @property
    def munge_socket(self) -> Path:
        return self.sock / "munge.socket"

    @property
    def munge_key(self) -> Path:
        return self.root / "munge" / "munge.key"

    @property
    def mysql_socket(self) -> Path:
        return self.sock / "mariadb.sock"

    @property
    def mysql_data(self) -> Path:
        return self.root / "mariadb" / "data"

    @property
    def ctld_state(self) -> Path:
        return self.root / "state" / "slurmctld"

    @property
    def spool_root(self) -> Path:
        return self.short / "spool"

    def spool(self, node: str) -> Path:
        return self.spool_root / node

    def gpu_files(self, node: str, count: int) -> list[Path]:
        """The files gres.conf names as ``node``'s GPUs (``File=``): Slurm takes a GPU's index from the
        number its file name ends with, as it does for /dev/nvidia<N>."""
        return [self.root / "dev" / node / f"nvidia{i}" for i in range(count)]

    def node_dir(self, node: str) -> Path:
        """The node's own disk: its /tmp and /var/tmp live here (bind-mounted inside its namespace)."""
        return self.root / "nodes" / node

    @property
    def hosts_file(self) -> Path:
        """The names every node resolves (bind-mounted over /etc/hosts inside each node)."""
        return self.etc / "hosts"

    @property
    def tag(self) -> str:
        """``dc`` + 8 hex digits of the state folder's hash: names this cluster's bridge, links and network
        namespaces (interface names are limited to 15 characters), so two clusters never share one."""
        return "dc" + hashlib.sha256(str(self.root).encode()).hexdigest()[:8]

    @property
    def bridge(self) -> str:
        return self.tag

    def netns(self, node: str) -> str:
        """The node's network namespace (``ip netns``) and the name of its link's end on this machine."""
        return f"{self.tag}-{node}"

    @property
    def probe_name(self) -> str:
        """A name of this cluster's own, for the cgroup it makes and removes to test cgroups are usable."""
        return f"devcluster_{hashlib.sha256(str(self.root).encode()).hexdigest()[:8]}_probe"

    def log_file(self, name: str) -> Path:
        return self.log / f"{name}.log"

    def dirs(self) -> list[Path]:
        return [self.etc, self.log, self.pids, self.run, self.sock, self.munge_key.parent,
                self.mysql_data.parent, self.ctld_state, self.root / "tmp",
                *(self.spool(n) for n in NODES), *(self.root / "dev" / n for n in NODES),
                *(self.node_dir(n) for n in NODES)]

    def make_dirs(self) -> None:
        # 0700 everywhere: munged refuses sockets and keys in folders others can write to.
        for top in {self.root, self.short}:
            top.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(top, 0o700)
        for d in self.dirs():
            d.mkdir(mode=0o700, parents=True, exist_ok=True)


def default_root() -> Path:
    """``.devcluster/`` at the repository root (this file is ``<repo>/slurm/devcluster_lib/layout.py``)."""
    return Path(__file__).resolve().parents[2] / ".devcluster"


def _port_free(port: int) -> bool:
    # Daemons bind loopback, but a service on 0.0.0.0 would still clash, so test the wildcard address.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _pick_port_base(root: Path) -> int:
    lo, hi = PORT_RANGE
    slots = (hi - lo) // PORT_STEP + 1
    start = int(hashlib.sha256(str(root).encode()).hexdigest(), 16) % slots
    for i in range(slots):
        base = lo + ((start + i) % slots) * PORT_STEP
        if all(_port_free(base + k) for k in range(SLURMD0 + len(NODES))):
            return base
    raise RuntimeError(f"no free block of {PORT_STEP} ports in {PORT_RANGE} on this machine")


def load_settings(layout: Layout) -> Settings | None:
    if not layout.state_json.exists():
        return None
    return Settings(**json.loads(layout.state_json.read_text()))


def save_settings(layout: Layout, settings: Settings) -> None:
    fd = os.open(layout.state_json, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(dataclasses.asdict(settings), f, indent=1)


def ensure_settings(layout: Layout, mode: str, pick_subnet: Callable[[Path], str]) -> Settings:
    """The persisted settings, choosing and saving them on first use (a state.json from before the nodes
    had addresses gets its subnet now). ``mode`` is the one asked for: a change is the caller's to allow."""
    found = load_settings(layout)
    if found is None:
        found = Settings(port_base=_pick_port_base(layout.root), db_password=secrets.token_hex(16), mode=mode)
    elif found.subnet and found.mode == mode:
        return found
    settings = dataclasses.replace(found, mode=mode, subnet=found.subnet or pick_subnet(layout.root))
    save_settings(layout, settings)
    return settings
