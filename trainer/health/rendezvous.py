"""The start-up preflight's first part, before any process group exists: can this rank reach the rendezvous,
and does the interface the site names for gloo/NCCL exist here? (torch-free)

``torch.distributed``'s TCP rendezvous waits for ``MASTER_ADDR:MASTER_PORT`` for the process group's whole
timeout (30 minutes) when the name does not resolve on a node, resolves to an address the node cannot
reach (a loopback address, a name that is another host on this node), or nothing answers there; a
``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` that names no interface of the node fails inside the backend
with a message that does not say which node. :func:`check_rendezvous` names each of these within
``train.preflight_timeout_s``, on the rank and node that sees it:

- ``MASTER_ADDR`` must resolve on every node; where the job spans nodes, not to a loopback address;
- rank 0 must own the address (its store listens there); the other ranks must get an answer from it: a
  connection (the store is up) within the timeout. "Refused" means the host answers but rank 0's store is
  not listening (rank 0 failed to start, or the address is another host); no answer means no route or a
  firewall between the nodes;
- every interface named by ``GLOO_SOCKET_IFNAME`` (a comma-separated list, as gloo reads it) exists on the
  node; ``NCCL_SOCKET_IFNAME`` (prefixes, ``^`` to exclude, ``=`` for exact names, as NCCL reads it)
  matches one of its interfaces when the backend is NCCL.

Rank 0 logs where the rendezvous is and which interface carries gloo's and NCCL's traffic (from the site's
``cluster.env``, else the address the node's host name resolves to).
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import os
import socket
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass

from trainer.health.config import HealthConfig
from trainer.health.heartbeat import node_name
from trainer.log import get_logger

log = get_logger(__name__)

GLOO_IFNAME, NCCL_IFNAME = "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915
_RETRY_S = 0.25


class RendezvousError(RuntimeError):
    """This rank cannot reach the rendezvous, or an interface named for the backend is missing here."""


@dataclass(frozen=True)
class Rendezvous:
    """Where this rank meets the others (``trainer.parallel.launch.DistEnv``'s fields that matter here)."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    backend: str  # 'gloo' or 'nccl'


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface ``name`` on this node (its network namespace), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])


def interfaces() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


def nccl_matches(spec: str, names: list[str]) -> list[str]:
    """The interfaces NCCL would consider for ``NCCL_SOCKET_IFNAME=spec``: prefixes by default, exact
    names after ``=``, everything but the listed ones after ``^``."""
    exact = spec.startswith("=") or spec.startswith("^=")
    exclude = spec.startswith("^")
    words = [w for w in spec.lstrip("^").lstrip("=").split(",") if w]

    def hit(name: str) -> bool:
        return any(name == w if exact else name.startswith(w) for w in words)

    return [n for n in names if hit(n) != exclude]


def _ifname_problems(environ: Mapping[str, str], backend: str, names: list[str]) -> list[str]:
    out = []
    gloo = environ.get(GLOO_IFNAME, "")
    missing = [n for n in gloo.split(",") if n and n not in names]
    if missing:
        out.append(f"{GLOO_IFNAME}={gloo} names {', '.join(missing)}, which this node does not have")
    nccl = environ.get(NCCL_IFNAME, "")
    if backend == "nccl" and nccl and not nccl_matches(nccl, names):
        out.append(f"{NCCL_IFNAME}={nccl} matches none of this node's interfaces")
    return out


def describe_sockets(environ: Mapping[str, str] | None = None) -> str:
    """'GLOO_SOCKET_IFNAME=eth0 (10.1.2.3), NCCL_SOCKET_IFNAME unset': what each backend binds to here."""
    env = os.environ if environ is None else environ
    parts = []
    for var in (GLOO_IFNAME, NCCL_IFNAME):
        value = env.get(var)
        if not value:
            parts.append(f"{var} unset")
            continue
        names = nccl_matches(value, interfaces()) if var == NCCL_IFNAME else value.split(",")
        where = ", ".join(f"{n} {interface_address(n) or 'no IPv4 address'}" for n in names if n)
        parts.append(f"{var}={value} ({where or 'no such interface'})")
    return ", ".join(parts)


def _multi_node(environ: Mapping[str, str], world_size: int) -> bool:
    for key in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        if environ.get(key, "").isdigit():
            return int(environ[key]) > 1
    local = environ.get("LOCAL_WORLD_SIZE", "")
    return local.isdigit() and int(local) < world_size


def _resolve(rv: Rendezvous, node: str) -> str:
    try:
        infos = socket.getaddrinfo(rv.master_addr, rv.master_port, socket.AF_INET, socket.SOCK_STREAM)
    except OSError as e:
        raise RendezvousError(
            f"preflight: MASTER_ADDR={rv.master_addr} does not resolve on node {node} (rank {rv.rank}: "
            f"{e.strerror or e}): the ranks cannot meet there. Every node must resolve the first node's name "
            "(DNS or /etc/hosts), or MASTER_ADDR must be an address") from None
    return infos[0][4][0]


def _answer(address: str, port: int, deadline: float) -> tuple[bool, str]:
    """Connect until one succeeds or ``deadline`` passes; (answered, the last failure)."""
    last = "no attempt"
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((address, port), timeout=max(min(2.0, left), 0.05)):
                return True, ""
        except ConnectionRefusedError:
            last = "refused"
        except OSError as e:
            last = "no answer" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        if time.monotonic() + _RETRY_S >= deadline:
            return False, last
        time.sleep(_RETRY_S)


def _owns(address: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, 0))
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                return False
            raise
    return True


def check_rendezvous(cfg: HealthConfig, rv: Rendezvous, environ: Mapping[str, str] | None = None) -> str:
    """Raise :class:`RendezvousError` naming what this rank cannot reach or use (module doc); the address
    MASTER_ADDR resolves to here."""
    env = os.environ if environ is None else environ
    node, timeout = node_name(), cfg.preflight_timeout_s
    problems = _ifname_problems(env, rv.backend, interfaces())
    if problems:
        raise RendezvousError(f"preflight: on node {node} (rank {rv.rank}): {'; '.join(problems)} (its "
                              f"interfaces: {', '.join(interfaces())}). Set it in the site's cluster.env to "
                              "an interface every node has")
    address = _resolve(rv, node)
    if ipaddress.ip_address(address).is_loopback and _multi_node(env, rv.world_size):
        raise RendezvousError(
            f"preflight: MASTER_ADDR={rv.master_addr} resolves to the loopback address {address} on node "
            f"{node} (rank {rv.rank}): the job spans nodes, and no other node can reach that. Make the node "
            "names resolve to the nodes' network addresses (not 127.x in /etc/hosts)")
    if rv.rank == 0:
        if not _owns(address):
            raise RendezvousError(
                f"preflight: MASTER_ADDR={rv.master_addr} ({address}) is not an address of node {node}, "
                "where rank 0 runs its rendezvous store: the others would wait for it in vain. MASTER_ADDR "
                "must name the job's first node")
        log.info("rendezvous %s:%d (%s) on node %s; sockets: %s", rv.master_addr, rv.master_port, address,
                 node, describe_sockets(env))
        return address
    answered, why = _answer(address, rv.master_port, time.monotonic() + timeout)
    if not answered:
        hint = ("the host answers but nothing listens there: rank 0 did not start its store (see rank 0's "
                "log) or MASTER_ADDR names another host" if why == "refused" else
                "no route or a firewall between this node and the first node, or that node is down")
        raise RendezvousError(
            f"preflight: rank {rv.rank} on node {node} got no connection from the rendezvous MASTER_ADDR="
            f"{rv.master_addr}:{rv.master_port} ({address}) within {timeout:g} s "
            f"(train.preflight_timeout_s): {why}: {hint}")
    return address
