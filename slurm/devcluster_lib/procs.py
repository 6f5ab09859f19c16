"""Starting, checking and stopping the daemons of one devcluster, by pid file.

Every process we start carries ``DEVCLUSTER_STATE=<state folder>`` in its environment. A pid is treated as
ours only when that marker is in ``/proc/<pid>/environ`` (so a recycled pid is never killed), and ``down``
can also find what our daemons spawned and left behind (slurmstepd inherits slurmd's environment).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .layout import Layout

MARKER = "DEVCLUSTER_STATE"


class DaemonError(RuntimeError):
    """A daemon failed to start or become ready; the message names its log and shows its tail."""


@dataclass(frozen=True)
class Daemon:
    """One long-running process of the cluster, always run in the foreground under our pid file."""

    name: str  # unique within the cluster, e.g. "slurmd-n1"; names the pid and log files
    argv: tuple[str, ...]  # full command line; must not daemonize itself
    log: Path  # where its own log goes (its stdout/stderr go to <log>.out beside it)

    def __post_init__(self) -> None:
        if not self.argv:
            raise ValueError(f"Daemon {self.name}: empty argv")

    @property
    def console(self) -> Path:
        return self.log.with_suffix(".out")


def marker_value(layout: Layout) -> str:
    return f"{MARKER}={layout.root}"


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def is_ours(pid: int, layout: Layout) -> bool:
    """Whether ``pid`` is a live process started by this cluster (marker in its environment)."""
    if pid <= 0 or _is_zombie(pid):
        return False
    return marker_value(layout).encode() in _environ(pid).split(b"\0")


def listening_inodes(port: int, pid: int | None = None) -> set[str]:
    """Socket inodes listening on TCP ``port`` (any address) in this process's network namespace, or in
    process ``pid``'s (a node's), from /proc/<pid>/net/tcp{,6}."""
    inodes = set()
    where = "self" if pid is None else str(pid)
    for table in (f"/proc/{where}/net/tcp", f"/proc/{where}/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])
    return inodes


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` itself listens on ``port`` (not merely: something answers there)."""
    wanted = {f"socket:[{i}]" for i in listening_inodes(port, pid)}
    if not wanted:
        return False
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                return True
        except OSError:
            continue
    return False


def pid_file(layout: Layout, name: str) -> Path:
    return layout.pids / f"{name}.pid"


def running_pid(layout: Layout, name: str) -> int | None:
    """The pid of daemon ``name`` when it is running, else None (a stale pid file is removed)."""
    path = pid_file(layout, name)
    try:
        pid = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if is_ours(pid, layout):
        return pid
    path.unlink(missing_ok=True)
    return None


def tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text[-lines:]) or f"({path} is empty)"


def failure(daemon: Daemon, why: str) -> DaemonError:
    """A DaemonError naming the daemon's log files and showing their last lines."""
    parts = [f"{daemon.name} {why}.", f"  command: {' '.join(daemon.argv)}"]
    for path in (daemon.log, daemon.console):
        if path.exists():
            parts.append(f"  log {path} (last lines):\n" + tail(path))
    if len(parts) == 2:
        parts.append(f"  no log written (expected {daemon.log})")
    return DaemonError("\n".join(parts))


def start(daemon: Daemon, layout: Layout, env: dict[str, str]) -> subprocess.Popen:
    """Start ``daemon`` detached (own session, stdin closed, output to its console file)."""
    full_env = dict(env)
    full_env[MARKER] = str(layout.root)
    with open(daemon.console, "ab") as out:
        try:
            proc = subprocess.Popen(daemon.argv, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=full_env, cwd=layout.root,
                                    start_new_session=True, close_fds=True)
        except OSError as exc:
            raise failure(daemon, f"could not be executed ({exc})") from exc
    pid_file(layout, daemon.name).write_text(f"{proc.pid} {daemon.argv[0]}\n")
    return proc


def wait_ready(daemon: Daemon, proc: subprocess.Popen, ready: Callable[[int], bool], timeout: float) -> None:
    """Poll ``ready(pid)`` until true; raise with the log tail if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        if proc.poll() is not None:
            raise failure(daemon, f"exited with status {proc.returncode} while starting")
        if ready(proc.pid):
            return
        if time.monotonic() > deadline:
            raise failure(daemon, f"did not become ready within {timeout:.0f} s")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)


def belongs(pid: int, layout: Layout, netns: frozenset[int] = frozenset()) -> bool:
    """Ours by the marker, or (``netns``: this cluster's nodes' network namespaces) by where it runs."""
    return is_ours(pid, layout) or bool(netns) and _netns_inode(pid) in netns and not _is_zombie(pid)


def _wait_gone(pids: list[int], layout: Layout, timeout: float, netns: frozenset[int]) -> list[int]:
    deadline = time.monotonic() + timeout
    left = [p for p in pids if belongs(p, layout, netns)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if belongs(p, layout, netns)]
    return left


def terminate(pids: list[int], layout: Layout, timeout: float, netns: frozenset[int] = frozenset()) -> None:
    """SIGTERM, wait up to ``timeout`` s, then SIGKILL whatever of ours is left."""
    for pid in pids:
        if belongs(pid, layout, netns):
            _signal(pid, signal.SIGTERM)
    for pid in _wait_gone(pids, layout, timeout, netns):
        _signal(pid, signal.SIGKILL)
    _wait_gone(pids, layout, 5.0, netns)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def stop(layout: Layout, name: str, timeout: float = 20.0) -> int | None:
    """Stop daemon ``name`` if running; its pid when it was running."""
    pid = running_pid(layout, name)
    if pid is not None:
        terminate([pid], layout, timeout)
    pid_file(layout, name).unlink(missing_ok=True)
    return pid


def wait_reaped(pids: list[int], timeout: float) -> None:
    """Wait until the dead ``pids`` are gone from /proc altogether.

    Our daemons are orphans whose parent is PID 1; where PID 1 reaps lazily (some VM/container inits),
    they linger as zombies for a second or two, and a `pgrep` right after `down` would still list them.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
        time.sleep(0.1)


def marked_pids(layout: Layout, netns: frozenset[int] = frozenset()) -> list[int]:
    """Every live process carrying this cluster's marker (daemons and what they spawned), or running in one
    of the network namespaces whose inodes ``netns`` holds (a node's: its job steps carry the job's
    environment, not the marker), except us."""
    own = {os.getpid(), os.getppid()}
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in own:
            continue
        if belongs(int(entry), layout, netns):
            found.append(int(entry))
    return found


def _netns_inode(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None
