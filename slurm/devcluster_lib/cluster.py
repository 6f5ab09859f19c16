"""``up``, ``down`` and ``status`` of one devcluster."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable

from . import conf, daemons, hosts, install, machine, procs, pyxis
from .layout import HOSTS, NODES, SLURMD0, Layout, Settings, ensure_settings, load_settings
from .procs import DaemonError

Say = Callable[[str], None]
# Node states in which a node is up and schedulable (sinfo %t short names; "*" = not responding).
GOOD_STATES = ("idle", "mix", "alloc", "comp")
BAD_STATES = ("down", "drain", "drng", "fail", "failg", "inval")


def sinfo_states(layout: Layout) -> dict[str, str] | None:
    """``{node: state}`` from sinfo, or None when slurmctld does not answer."""
    try:
        res = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=15,
                             env=daemons.client_env(layout))
    except subprocess.TimeoutExpired:
        return None
    if res.returncode != 0:
        return None
    return dict(line.split(None, 1) for line in res.stdout.splitlines() if line.strip())


def _ready_nodes(states: dict[str, str] | None) -> bool:
    return states is not None and all(states.get(n, "").rstrip("~#$@^-") in GOOD_STATES for n in NODES)


def up(layout: Layout, say: Say, mode: str = HOSTS) -> None:
    """Install what is missing, start what is not running, and wait until every node is schedulable.
    ``mode``: HOSTS (each node its own host: hosts.py) or SINGLE_HOST (every node is this host)."""
    started = time.monotonic()
    hostname = socket.gethostname().split(".")[0]
    install.ensure_packages(say)
    if mode == HOSTS and (problem := hosts.namespaces_problem()) is not None:
        raise install.Refusal(hosts.refusal(problem))
    _check_mode_change(layout, mode)
    install.ensure_hosts(say, hostname, node_names=mode != HOSTS)
    layout.make_dirs()
    settings = ensure_settings(layout, mode, hosts.pick_subnet)
    if settings.hosts:
        _network(layout, settings, hostname, say)
    all_steps = daemons.steps(layout, settings)
    found = machine.detect(daemons.daemon_env(layout), layout.probe_name)
    say(_binding_line(found))
    runtime = pyxis.find()
    say(pyxis.describe(runtime))
    if runtime is not None:
        _enroot_folders(layout, runtime)
    if conf.write_all(layout, settings, hostname, found, pyxis.plugstack(layout, runtime)):
        restarted = [s.daemon.name for s in reversed(all_steps)
                     if s.slurm and procs.stop(layout, s.daemon.name)]
        if restarted:
            say(f"configuration changed: restarting {', '.join(restarted)}")
    launched = _start(layout, settings, all_steps)
    _wait_nodes(layout, say)
    if settings.hosts:
        _check_links(layout, settings)
    if launched:
        say(f"started {' '.join(launched)} in {time.monotonic() - started:.1f} s; state in {layout.root}")
    else:
        say(f"already up ({time.monotonic() - started:.1f} s); state in {layout.root}")


def _check_mode_change(layout: Layout, mode: str) -> None:
    old = load_settings(layout)
    if old is None or old.mode == mode:
        return
    running = [n for n in ("slurmctld", *(f"slurmd-{x}" for x in NODES)) if procs.running_pid(layout, n)]
    if running:
        raise install.Refusal(f"this cluster runs as {old.mode} ({', '.join(running)} running): "
                              f"`slurm/devcluster down` before `up` as {mode}")


def _network(layout: Layout, settings: Settings, hostname: str, say: Say) -> None:
    """The nodes' network, hosts file and folders (hosts.py)."""
    if hosts.ensure_shared_root():
        say("made / a shared mount (mount --make-shared /, as systemd does at boot): what this machine "
            "mounts later reaches the nodes")
    hosts.prepare_shared(layout)
    for node in NODES:
        hosts.prepare_node_dirs(layout, node)
    conf.write_if_changed(layout.hosts_file, hosts.hosts_text(layout, settings, hostname))
    try:
        made = hosts.ensure_network(layout, settings)
    except hosts.NetError as exc:
        raise install.SetupError(str(exc)) from exc
    addresses = " ".join(f"{n}={a}" for n, a in hosts.node_addresses(settings.subnet).items())
    made_text = f"; made {', '.join(made)}" if made else ""
    say(f"nodes as hosts on bridge {layout.bridge} ({settings.subnet}, this machine "
        f"{hosts.bridge_address(settings.subnet)}): {addresses}{made_text}")


def _start(layout: Layout, settings: Settings, all_steps: list[daemons.Step]) -> list[str]:
    launched = []
    for step in all_steps:
        name = step.daemon.name
        if procs.running_pid(layout, name) is not None:
            continue
        if step.port is not None and procs.listening_inodes(step.port):
            raise DaemonError(f"{name} cannot start: port {step.port} is taken by another process (see "
                              f"`ss -ltnp | grep :{step.port}`). Free it, or `down`, delete "
                              f"{layout.state_json} and `up` again to pick other ports")
        daemons.prepare(name, layout, settings)
        proc = procs.start(step.daemon, layout, daemons.daemon_env(layout))
        procs.wait_ready(step.daemon, proc, step.ready, step.timeout_s)
        daemons.after_start(name, layout, settings)
        launched.append(f"{name}({proc.pid})")
    return launched


def _check_links(layout: Layout, settings: Settings) -> None:
    """Each node reaches the next one's slurmd through the bridge (a firewall on bridged traffic, say,
    would let slurmctld see every node yet keep the nodes from each other)."""
    ports = {step.node: step.daemon for step in daemons.steps(layout, settings) if step.node}
    addresses = hosts.node_addresses(settings.subnet)
    order = list(NODES)
    for i, node in enumerate(order):
        peer = order[(i + 1) % len(order)]
        port = settings.port(SLURMD0 + order.index(peer))
        probe = f"import socket; socket.create_connection(({addresses[peer]!r}, {port}), timeout=10).close()"
        argv = ["nsenter", f"--net=/run/netns/{layout.netns(node)}", sys.executable, "-c", probe]
        res = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        if res.returncode != 0:
            last = (res.stderr.strip().splitlines() or ["?"])[-1]
            raise DaemonError(f"node {node} cannot reach node {peer} ({addresses[peer]}:{port}, "
                              f"{ports[peer].name}) over bridge {layout.bridge}: {last}. A firewall on "
                              "bridged traffic? (sysctl net.bridge.bridge-nf-call-iptables)")


def _enroot_folders(layout: Layout, runtime: pyxis.Pyxis) -> None:
    drop_in = pyxis.drop_in(runtime.sysconf)
    try:
        drop_in.parent.mkdir(parents=True, exist_ok=True)
        conf.write_if_changed(drop_in, pyxis.enroot_folders(layout))
    except OSError as exc:
        raise install.SetupError(f"cannot write enroot's per-node folders to {drop_in} ({exc}): run up as "
                                 "root, or uninstall pyxis from this machine") from exc


def _binding_line(found: machine.Machine) -> str:
    how = ("task/cgroup + task/affinity, proctrack/cgroup (cgroup v1: cpuset, memory)" if found.cgroups
           else f"task/affinity, proctrack/linuxproc (no cgroups: {found.cgroup_problem})")
    return (f"nodes of {found.cpus} CPUs ({found.sockets}x{found.cores_per_socket}x{found.threads_per_core}) "
            f"and {found.memory_mb} MB each; binding: {how}")


def _wait_nodes(layout: Layout, say: Say, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    resumed = False
    while True:
        states = sinfo_states(layout)
        if _ready_nodes(states):
            return
        bad = [n for n in NODES if states and states.get(n, "").rstrip("*~#$@^-") in BAD_STATES]
        if bad and not resumed:
            # A node left down/drained by an earlier run (e.g. killed slurmd) is healthy again now.
            say(f"resuming {','.join(bad)} (was {', '.join(states[n] for n in bad)})")
            subprocess.run(["scontrol", "update", f"nodename={','.join(bad)}", "state=resume"],
                           capture_output=True, timeout=15, env=daemons.client_env(layout))
            resumed = True
        if time.monotonic() > deadline:
            raise DaemonError(_nodes_failure(layout, states, timeout))
        time.sleep(0.3)


def _nodes_failure(layout: Layout, states: dict[str, str] | None, timeout: float) -> str:
    lines = [f"nodes not idle after {timeout:.0f} s: {states if states is not None else 'sinfo fails'}"]
    reasons = subprocess.run(["sinfo", "-R"], capture_output=True, text=True, timeout=15,
                             env=daemons.client_env(layout))
    lines.append(reasons.stdout.strip() or reasons.stderr.strip())
    for name in ["slurmctld", *(f"slurmd-{n}" for n in NODES)]:
        path = layout.log / f"{name}.log"
        lines.append(f"log {path} (last lines):\n{procs.tail(path, 12)}")
    return "\n".join(lines)


def _cancel_jobs(layout: Layout, say: Say) -> list[int]:
    """Cancel every job so its slurmstepd and tasks end cleanly before slurmd stops; the stepd pids."""
    if procs.running_pid(layout, "slurmctld") is None:
        return []
    res = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True, timeout=15,
                         env=daemons.client_env(layout))
    jobs = res.stdout.split() if res.returncode == 0 else []
    if not jobs:
        return []
    stepds = _stepd_pids(layout)
    say(f"cancelling {len(jobs)} job(s)")
    subprocess.run(["scancel", *jobs], capture_output=True, timeout=30, env=daemons.client_env(layout))
    # KillWait is 5 s: give the steps that long plus margin to exit by themselves.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and _stepd_pids(layout):
        time.sleep(0.2)
    return stepds


def _stepd_pids(layout: Layout) -> list[int]:
    pids = []
    for pid in procs.marked_pids(layout):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(b"slurmstepd"):
                    pids.append(pid)
        except OSError:
            pass
    return pids


def down(layout: Layout, say: Say) -> None:
    """Stop exactly what this cluster started (pid files, then any process carrying its marker or running
    in one of its nodes), then remove its nodes' namespaces, links and bridge."""
    settings = load_settings(layout)
    leftover_net = hosts.leftovers(layout)
    if settings is None and not layout.pids.exists() and not leftover_net:
        say(f"nothing to stop: no devcluster state in {layout.root}")
        return
    netns = frozenset(hosts.netns_inodes(layout))  # before the namespaces go: what runs in them is ours
    stopped, pids = [], _cancel_jobs(layout, say)
    for step in reversed(daemons.steps(layout, settings)) if settings else []:
        pid = procs.stop(layout, step.daemon.name, timeout=30)
        if pid is not None:
            stopped.append(step.daemon.name)
            pids.append(pid)
    leftovers = procs.marked_pids(layout, netns)
    if leftovers:
        say(f"stopping {len(leftovers)} leftover process(es) of this cluster: {leftovers}")
        procs.terminate(leftovers, layout, 10, netns)
    procs.wait_reaped(pids + leftovers, timeout=10)
    if leftover_net:
        removed = hosts.remove_network(layout)
        still = hosts.leftovers(layout)
        if still:
            raise DaemonError(f"could not remove {', '.join(still)} (`ip netns pids NAME` shows what holds "
                              "a namespace)")
        say(f"removed the nodes' network: {', '.join(removed)}")
    if layout.short != layout.root:  # sockets and spools moved to /tmp for a long state path
        shutil.rmtree(layout.short, ignore_errors=True)
    released = pyxis.release(layout)
    if released is not None:
        say(f"removed enroot's per-node folders for this cluster ({released})")
    say(f"stopped {' '.join(stopped) or 'nothing (was not running)'}")


def link(layout: Layout, node: str, up_: bool, say: Say) -> None:
    """Take ``node``'s link down (its traffic to every other node and to this machine is lost, silently,
    as with a pulled cable) or bring it back up."""
    settings = load_settings(layout)
    if settings is None or not settings.hosts:
        raise install.Refusal(f"no cluster of separate hosts in {layout.root}: links exist only between "
                              "nodes that are hosts of their own (`up` without --single-host)")
    hosts.set_link(layout, node, up_)
    say(f"link of node {node} ({layout.netns(node)}) {'up' if up_ else 'down'}")
    if up_ and procs.running_pid(layout, "slurmctld") is not None:
        _back_in_service(layout, node, say)


def _back_in_service(layout: Layout, node: str, say: Say, timeout: float = 60.0) -> None:
    """A node Slurm set DOWN while it was cut off returns at its next registration (ReturnToService=2),
    which slurmctld asks a DOWN node for only now and then: resume it now, as an admin would, and wait
    until it answers."""
    deadline = time.monotonic() + timeout
    resumed = False
    while True:
        state = (sinfo_states(layout) or {}).get(node, "")
        if state.rstrip("~#$@^-") in GOOD_STATES:
            return
        if state.startswith(("down", "drain", "fail")) and not resumed:
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True,
                           timeout=15, env=daemons.client_env(layout))
            say(f"resumed node {node} (was {state})")
            resumed = True
        if time.monotonic() > deadline:
            raise DaemonError(f"node {node} not back in service {timeout:.0f} s after its link came up "
                              f"(state {state or '?'}; sinfo -R says why)")
        time.sleep(0.5)


def _conf_value(layout: Layout, key: str) -> str:
    for line in layout.slurm_conf.read_text().splitlines() if layout.slurm_conf.exists() else []:
        if line.startswith(f"{key}="):
            return line.split("=", 1)[1]
    return "?"


def status(layout: Layout, out: Say) -> int:
    """Print daemon and node state; 0 when every daemon runs and both nodes are schedulable."""
    settings = load_settings(layout)
    if settings is None:
        out(f"devcluster: no state in {layout.root} (run: slurm/devcluster up)")
        return 1
    ok = True
    out(f"devcluster state {layout.root}  SLURM_CONF={layout.slurm_conf}  ports {settings.port_base}+")
    out(f"  binding: {_conf_value(layout, 'TaskPlugin')}, {_conf_value(layout, 'ProctrackType')}")
    if settings.hosts:
        missing = sorted(set(layout.netns(n) for n in NODES) - hosts.netns_names())
        ok &= not missing
        addresses = " ".join(f"{n}={a}" for n, a in hosts.node_addresses(settings.subnet).items())
        out(f"  nodes as hosts: bridge {layout.bridge} {settings.subnet}: {addresses}"
            + (f"; MISSING namespaces {', '.join(missing)}" if missing else ""))
    else:
        out("  single host: every node is this machine (127.0.0.1, one /tmp)")
    for step in daemons.steps(layout, settings):
        pid = procs.running_pid(layout, step.daemon.name)
        ok &= pid is not None
        state = f"running pid {pid}" if pid else "stopped"
        out(f"  {step.daemon.name:<10} {state:<17} log {step.daemon.log}")
    states = sinfo_states(layout) if procs.running_pid(layout, "slurmctld") else None
    if states is None:
        out("  nodes: slurmctld not answering")
        return 1
    out("  nodes: " + "  ".join(f"{n}={s}" for n, s in sorted(states.items())))
    res = subprocess.run(["squeue", "-h", "-o", "%i %T %j"], capture_output=True, text=True, timeout=15,
                         env=daemons.client_env(layout))
    jobs = res.stdout.splitlines()
    out(f"  jobs: {len(jobs)}" + "".join(f"\n    {j}" for j in jobs[:20]))
    return 0 if ok and _ready_nodes(states) else 1
