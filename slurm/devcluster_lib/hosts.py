"""Every node its own host: a network namespace with its own address on a bridge the cluster makes, its own
host name (UTS namespace) and its own /tmp, /var/tmp and /dev/shm (mount namespace).

The network, made by ``up`` and removed by ``down`` (``ip``, as root):

- a bridge named ``layout.bridge`` on this machine with the first address of the cluster's /28
  (``Settings.subnet``, picked in 198.18.0.0/15 where no address or route of this machine is; persisted);
- per node a named network namespace (``ip netns``, ``layout.netns(node)``) holding ``lo`` and ``eth0``,
  one end of a veth pair whose other end, named like the namespace, is a port of the bridge. eth0 has the
  node's address and nothing else: no default route and no NAT, so a node reaches only the cluster's
  other nodes and this machine's bridge address (where slurmctld and slurmdbd listen). ``link`` takes a
  node's link down and up again, as a pulled cable would.

slurmd starts inside its node (:func:`node_argv`): ``nsenter`` into the network namespace, ``unshare`` a
UTS and a mount namespace (mounts of this machine still reach it: propagation ``slave``), set the host
name, bind the node's own folders over /tmp and /var/tmp, mount a fresh tmpfs on /dev/shm, bind the
cluster's hosts file over /etc/hosts, then exec slurmd. Job steps are slurmd's children, so they run in
the node's namespaces too. Everything else of this machine is shared, as a site's nodes share their
filesystems (the checkout, runs_root, the cache, the data and tokenizer folders), and so are, under /tmp,
the test suite's folder (SUITE_TMP), where the tests keep their runs, and the checkout the cluster runs
from (REPO: CI clones it under /tmp; its .venv is the software every job runs).

The hosts file names every node at its address and this machine (the login node) at the bridge address.
This machine's own /etc/hosts is not changed for the nodes: two clusters both have a node n1, at two
addresses, and nothing on the login side needs the node names (Slurm's clients use the addresses
slurm.conf gives).
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import pwd
import shlex
import subprocess
from pathlib import Path

from .layout import NET_PREFIX, NET_RANGE, NODES, Layout, Settings

NODE_IFNAME = "eth0"  # the node's interface, as on a real node (GLOO_SOCKET_IFNAME=eth0 on this site)
PRIVATE_DIRS = ("/tmp", "/var/tmp")  # each node's own; /dev/shm is a tmpfs of its own
# The test suite's folder (pytest's tmp_path lives below it): the tests keep their runs there, as a site
# keeps runs on a filesystem every node mounts, so the nodes share it; the rest of /tmp is each node's own.
SUITE_TMP = "/tmp/pytest-of-{user}"
REPO = Path(__file__).resolve().parents[2]  # the checkout: its .venv and .make/ are what the jobs run
IP_TIMEOUT_S = 30
# `ip route` words that come before a route's destination.
ROUTE_TYPES = ("local", "broadcast", "unreachable", "prohibit", "blackhole", "multicast", "anycast", "nat")


class NetError(RuntimeError):
    """A step of making or removing the cluster's network failed; the message names the command."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    except OSError as exc:
        raise NetError(f"`ip {' '.join(args)}` could not run ({exc}): install iproute2") from exc
    if check and res.returncode != 0:
        raise NetError(f"`ip {' '.join(args)}` failed: {res.stderr.strip() or res.stdout.strip()}")
    return res


# --- addresses ---------------------------------------------------------------------------------------
def bridge_address(subnet: str) -> str:
    return str(ipaddress.ip_network(subnet)[1])


def node_addresses(subnet: str) -> dict[str, str]:
    """{node: address}: the addresses after the bridge's, in the order of NODE_SPECS."""
    net = ipaddress.ip_network(subnet)
    return {node: str(net[2 + i]) for i, node in enumerate(NODES)}


def used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network this machine has an address in or a route to (default routes left out)."""
    words = [line.split()[3] for line in ip("-4", "-o", "addr", "show", check=False).stdout.splitlines()
             if len(line.split()) > 3]
    for line in ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        parts = line.split()
        if len(parts) > 1 and parts[0] in ROUTE_TYPES:
            parts = parts[1:]
        if parts and parts[0] != "default":
            words.append(parts[0])
    found = []
    for word in words:
        try:
            found.append(ipaddress.ip_network(word, strict=False))
        except ValueError:
            continue
    return found


def pick_subnet(root: Path, used: list[ipaddress.IPv4Network] | None = None) -> str:
    """A /28 of NET_RANGE that overlaps nothing this machine uses, starting from the state folder's hash
    (so two clusters start their search at different places, as their ports do)."""
    used = used_networks() if used is None else used
    subnets = list(ipaddress.ip_network(NET_RANGE).subnets(new_prefix=NET_PREFIX))
    start = int(hashlib.sha256(("net:" + str(root)).encode()).hexdigest(), 16) % len(subnets)
    for i in range(len(subnets)):
        candidate = subnets[(start + i) % len(subnets)]
        if not any(candidate.overlaps(u) for u in used):
            return str(candidate)
    raise NetError(f"no /{NET_PREFIX} of {NET_RANGE} is free on this machine")


# --- availability ------------------------------------------------------------------------------------
def namespaces_problem() -> str | None:
    """None when this machine lets us make the nodes' namespaces and links, else why not (one line)."""
    if os.geteuid() != 0:
        return "not root (making network namespaces and a bridge needs CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    for tool in ("ip", "nsenter", "unshare"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode != 0:
            return f"no `{tool}` here (iproute2, util-linux)"
    res = subprocess.run(["unshare", "--net", "--uts", "--mount", "true"], capture_output=True, text=True,
                         timeout=IP_TIMEOUT_S)
    if res.returncode != 0:
        return f"`unshare --net --uts --mount` is refused: {res.stderr.strip() or res.returncode}"
    return None


def refusal(problem: str) -> str:
    return (f"the nodes cannot be separate hosts here: {problem}. Run `up` as root on Linux (CI does), or "
            "`slurm/devcluster up --single-host` for nodes that all share this host (multi-node bugs then "
            "pass unseen)")


# --- the network -------------------------------------------------------------------------------------
def _exists(*args: str) -> bool:
    return ip(*args, check=False).returncode == 0


def netns_names() -> set[str]:
    return {line.split()[0] for line in ip("netns", "list", check=False).stdout.splitlines() if line.strip()}


def _claimed_by_other(subnet: str, bridge: str) -> str | None:
    """The interface other than our bridge holding an address in ``subnet``, if any."""
    net = ipaddress.ip_network(subnet)
    for line in ip("-4", "-o", "addr", "show", check=False).stdout.splitlines():
        words = line.split()
        if len(words) > 3 and words[1] != bridge and \
                ipaddress.ip_network(words[3], strict=False).overlaps(net):
            return f"{words[1]} ({words[3]})"
    return None


def ensure_network(layout: Layout, settings: Settings) -> list[str]:
    """Make what is missing of the bridge, the nodes' namespaces and links; what was made (idempotent)."""
    made, bridge, subnet = [], layout.bridge, settings.subnet
    prefix = f"/{ipaddress.ip_network(subnet).prefixlen}"
    other = _claimed_by_other(subnet, bridge)
    if other is not None:
        raise NetError(f"the cluster's subnet {subnet} (state.json) is in use by {other}: another cluster or "
                       f"network has it. `down`, delete {layout.state_json} and `up` again to pick another")
    if not _exists("link", "show", bridge):
        ip("link", "add", bridge, "type", "bridge")
        made.append(f"bridge {bridge}")
    # Bridged frames skip this machine's iptables (br_netfilter would hand them to a FORWARD chain that a
    # container runtime may have set to DROP).
    ip("link", "set", bridge, "type", "bridge", "nf_call_iptables", "0", check=False)
    if bridge_address(subnet) not in ip("-4", "-o", "addr", "show", "dev", bridge).stdout:
        ip("addr", "add", bridge_address(subnet) + prefix, "dev", bridge)
    ip("link", "set", bridge, "up")
    present = netns_names()
    for node, address in node_addresses(subnet).items():
        ns = layout.netns(node)
        if ns not in present:
            ip("netns", "add", ns)
            made.append(f"netns {ns}")
        if not _exists("link", "show", ns):
            ip("link", "add", ns, "type", "veth", "peer", "name", NODE_IFNAME, "netns", ns)
        ip("link", "set", ns, "master", bridge, "up")
        if address not in ip("-n", ns, "-4", "-o", "addr", "show", "dev", NODE_IFNAME).stdout:
            ip("-n", ns, "addr", "add", address + prefix, "dev", NODE_IFNAME)
        ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", ns, "link", "set", NODE_IFNAME, "up")
    return made


def remove_network(layout: Layout) -> list[str]:
    """Delete this cluster's namespaces (their veth pairs go with them) and bridge; what was removed. Names
    come from the state folder's hash: another cluster's are never touched."""
    removed = []
    present = netns_names()
    for node in NODES:
        ns = layout.netns(node)
        if ns in present:
            ip("netns", "delete", ns)
            removed.append(ns)
        if _exists("link", "show", ns):  # a namespace still held by a process keeps its pair: cut it here
            ip("link", "delete", ns, check=False)
    if _exists("link", "show", layout.bridge):
        ip("link", "delete", layout.bridge)
        removed.append(layout.bridge)
    return removed


def leftovers(layout: Layout) -> list[str]:
    """This cluster's namespaces and links that still exist (empty after a clean ``down``)."""
    names = {layout.bridge, *(layout.netns(n) for n in NODES)}
    links = {line.split(":")[1].strip().split("@")[0] for line in
             ip("-o", "link", "show", check=False).stdout.splitlines() if ":" in line}
    return sorted((netns_names() | links) & names)


def netns_inodes(layout: Layout) -> dict[int, str]:
    """{inode of the node's network namespace: node} (a process whose /proc/<pid>/ns/net has that inode
    runs on the node)."""
    out = {}
    for node in NODES:
        try:
            out[os.stat(f"/run/netns/{layout.netns(node)}").st_ino] = node
        except OSError:
            continue
    return out


def set_link(layout: Layout, node: str, up: bool) -> None:
    """The node's link on the bridge down (a cut cable: its traffic goes nowhere, no error reaches either
    side) or up again."""
    if node not in NODES:
        raise NetError(f"no node {node!r} in this cluster (nodes: {', '.join(NODES)})")
    ip("link", "set", layout.netns(node), "up" if up else "down")


# --- the nodes' view ---------------------------------------------------------------------------------
def hosts_text(layout: Layout, settings: Settings, hostname: str) -> str:
    lines = [f"# slurm/devcluster ({layout.root}): the names its nodes resolve (over /etc/hosts inside each)",
             "127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback",
             f"{bridge_address(settings.subnet)} {hostname}  # this machine, the login node, on the bridge"]
    lines += [f"{address} {node}" for node, address in node_addresses(settings.subnet).items()]
    return "\n".join(lines) + "\n"


def _under(path: Path, folder: str) -> str | None:
    """``path`` relative to ``folder`` when it lies inside it."""
    try:
        return str(path.relative_to(folder))
    except ValueError:
        return None


def shared_folders(layout: Layout) -> list[Path]:
    """Folders under /tmp or /var/tmp that every node shares: the cluster's own state there (a state folder
    in /tmp, the short socket folder), the test suite's (SUITE_TMP) and the checkout (REPO), as a site's
    software and runs are on filesystems every node mounts."""
    return [layout.root, layout.short, Path(SUITE_TMP.format(user=pwd.getpwuid(os.geteuid()).pw_name)), REPO]


def prepare_shared(layout: Layout) -> None:
    """The shared folders exist on this machine before a node binds them (mode 0700, as pytest makes its)."""
    for folder in shared_folders(layout):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)


def node_script(layout: Layout, node: str) -> str:
    """The shell that makes a fresh UTS + mount namespace into the node and execs its arguments. The
    shared folders under /tmp or /var/tmp (:func:`shared_folders`) are bound back from the machine's:
    through the working directory, which still sees the folder the new mount covers."""
    q = shlex.quote
    lines = ["set -e", f"hostname {q(node)}"]
    for private in PRIVATE_DIRS:
        own = layout.node_dir(node) / private.strip("/").replace("/", "-")
        under = {r for p in shared_folders(layout) if (r := _under(p, private)) is not None}
        keep = sorted(r for r in under if not any(r.startswith(f"{o}/") for o in under))  # outermost
        lines += [f"cd {q(private)}", f"mount --bind {q(str(own))} {q(private)}"]
        # --no-canonicalize: mount(8) would make ./r absolute, which names the new, empty folder.
        lines += [f"mkdir -p {q(f'{private}/{r}')} && "
                  f"mount --no-canonicalize --bind {q('./' + r)} {q(f'{private}/{r}')}" for r in keep]
    lines += ["cd /", "mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm",
              f"mount --bind {q(str(layout.hosts_file))} /etc/hosts", 'exec "$@"']
    return "\n".join(lines)


def prepare_node_dirs(layout: Layout, node: str) -> None:
    for private in PRIVATE_DIRS:
        own = layout.node_dir(node) / private.strip("/").replace("/", "-")
        own.mkdir(parents=True, exist_ok=True)
        os.chmod(own, 0o1777)


def node_argv(layout: Layout, node: str, argv: tuple[str, ...]) -> tuple[str, ...]:
    """``argv`` run inside the node: its network namespace, a UTS and mount namespace of its own."""
    return ("nsenter", f"--net=/run/netns/{layout.netns(node)}", "--", "unshare", "--uts", "--mount",
            "--propagation", "slave", "--", "sh", "-c", node_script(layout, node), f"node-{node}", *argv)


# --- mount propagation -------------------------------------------------------------------------------
def root_is_shared() -> bool:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 6 and fields[4] == "/":
                return any(x.startswith("shared:") for x in fields[6:fields.index("-")])
    return False


def ensure_shared_root() -> bool:
    """Make ``/`` a shared mount (systemd does so at boot) so that what this machine mounts after ``up``
    (a test's tmpfs under a run folder) reaches the nodes, whose mounts follow this machine's (slave).
    True when it changed."""
    if root_is_shared():
        return False
    res = subprocess.run(["mount", "--make-shared", "/"], capture_output=True, text=True,
                         timeout=IP_TIMEOUT_S)
    if res.returncode != 0:
        raise NetError(f"`mount --make-shared /` failed: {res.stderr.strip()}")
    return True
