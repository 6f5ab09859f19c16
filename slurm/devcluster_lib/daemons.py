"""The daemons of the devcluster, in start order, with their one-time preparation and readiness checks."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .conf import LOOPBACK, user
from .hosts import node_argv
from .layout import CLUSTER_NAME, CTLD, DBD, MYSQL, NODES, SLURMD0, Layout, Settings
from .procs import Daemon, DaemonError, listens, tail

SBIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class Step:
    """A daemon plus how to tell it is ready, and how long to wait for that."""

    daemon: Daemon
    ready: Callable[[int], bool]  # given the daemon's pid
    timeout_s: float
    slurm: bool  # reads slurm.conf/slurmdbd.conf, so restarts when they change
    port: int | None = None  # TCP port it listens on (must be free on this host before it starts)
    node: str | None = None  # the node it runs in (nodes as hosts: its namespaces, not this host's)


def daemon_env(layout: Layout) -> dict[str, str]:
    """A small, fixed environment: slurmd hands its own to slurmstepd, so keep the caller's out of it."""
    return {"PATH": SBIN_PATH, "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8",
            "SLURM_CONF": str(layout.slurm_conf)}


def client_env(layout: Layout) -> dict[str, str]:
    env = dict(os.environ, SLURM_CONF=str(layout.slurm_conf))
    env["PATH"] = env.get("PATH", "") + ":" + SBIN_PATH
    return env


def listening_on(port: int) -> Callable[[int], bool]:
    return lambda pid: listens(pid, port)


def unix_open(path: Path) -> Callable[[int], bool]:
    def check(_pid: int) -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1)
            try:
                s.connect(str(path))
                return True
            except OSError:
                return False
    return check


def mysql(layout: Layout, sql: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
    """Run SQL as the database admin named like our OS user, over the unix socket (socket auth)."""
    argv = ["mariadb", "--no-defaults", f"--socket={layout.mysql_socket}", "-u", user(), "-N", "-e", sql]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=client_env(layout))


def steps(layout: Layout, settings: Settings) -> list[Step]:
    """Every daemon in start order (stop in reverse)."""
    conf = str(layout.slurm_conf)
    # --force: munged otherwise refuses to run as root; the key and socket are private to this folder.
    munged = Daemon("munged", (
        "munged", "--foreground", "--force", f"--socket={layout.munge_socket}",
        f"--key-file={layout.munge_key}", f"--pid-file={layout.run}/munged.pid",
        f"--log-file={layout.log_file('munged')}", f"--seed-file={layout.munge_key.parent}/munged.seed",
    ), layout.log_file("munged"))
    mariadbd = Daemon("mariadbd", (
        "mariadbd", "--no-defaults", f"--user={user()}", f"--datadir={layout.mysql_data}",
        f"--socket={layout.mysql_socket}", f"--port={settings.port(MYSQL)}", f"--bind-address={LOOPBACK}",
        f"--pid-file={layout.run}/mariadbd.pid", f"--log-error={layout.log_file('mariadbd')}",
        f"--tmpdir={layout.root}/tmp", "--skip-name-resolve", "--skip-log-bin", "--performance-schema=OFF",
        "--innodb-buffer-pool-size=128M", "--innodb-lock-wait-timeout=900", "--max-connections=64",
    ), layout.log_file("mariadbd"))
    dbd, ctld, db = settings.port(DBD), settings.port(CTLD), settings.port(MYSQL)
    out = [
        Step(munged, unix_open(layout.munge_socket), 15, slurm=False),
        Step(mariadbd, lambda pid: listens(pid, db) and mysql(layout, "SELECT 1", 5).returncode == 0, 60,
             slurm=False, port=db),
        Step(Daemon("slurmdbd", ("slurmdbd", "-D"), layout.log_file("slurmdbd")), listening_on(dbd), 90,
             slurm=True, port=dbd),
        Step(Daemon("slurmctld", ("slurmctld", "-D", "-f", conf), layout.log_file("slurmctld")),
             listening_on(ctld), 60, slurm=True, port=ctld),
    ]
    for i, node in enumerate(NODES):
        port = settings.port(SLURMD0 + i)
        argv: tuple[str, ...] = ("slurmd", "-D", "-N", node, "-f", conf)
        if settings.hosts:  # inside the node: its port is its own, whatever this host listens on
            out.append(Step(Daemon(f"slurmd-{node}", node_argv(layout, node, argv), layout.log /
                                   f"slurmd-{node}.log"), listening_on(port), 60, slurm=True, node=node))
        else:
            out.append(Step(Daemon(f"slurmd-{node}", argv, layout.log / f"slurmd-{node}.log"),
                            listening_on(port), 60, slurm=True, port=port, node=node))
    return out


def prepare(name: str, layout: Layout, settings: Settings) -> None:
    """One-time set-up a daemon needs before its first start (idempotent)."""
    if name == "munged" and not layout.munge_key.exists():
        fd = os.open(layout.munge_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))
    if name == "mariadbd" and not (layout.mysql_data / "mysql").is_dir():
        _install_db(layout)


def _install_db(layout: Layout) -> None:
    log = layout.log_file("mariadb-install-db")
    argv = ["mariadb-install-db", "--no-defaults", f"--user={user()}", f"--datadir={layout.mysql_data}",
            "--skip-test-db", "--skip-name-resolve", "--auth-root-authentication-method=socket",
            f"--tmpdir={layout.root}/tmp"]
    with open(log, "w") as f:
        res = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env=daemon_env(layout), cwd=layout.root)
    if res.returncode != 0:
        raise DaemonError(f"mariadb-install-db failed (status {res.returncode}).\n"
                          f"  command: {' '.join(argv)}\n  log {log} (last lines):\n{tail(log)}")


def after_start(name: str, layout: Layout, settings: Settings) -> None:
    """Set-up that needs the daemon running: the slurmdbd database user, the cluster's accounting entry."""
    if name == "mariadbd":
        pw = settings.db_password
        sql = (f"CREATE USER IF NOT EXISTS 'slurm'@'{LOOPBACK}' IDENTIFIED BY '{pw}'; "
               f"ALTER USER 'slurm'@'{LOOPBACK}' IDENTIFIED BY '{pw}'; "
               f"GRANT ALL ON slurm_acct_db.* TO 'slurm'@'{LOOPBACK}';")
        res = mysql(layout, sql)
        if res.returncode != 0:
            raise DaemonError(f"creating the slurm database user failed: {res.stderr.strip()}\n"
                              f"  MariaDB log: {layout.log_file('mariadbd')}")
    if name == "slurmdbd":
        _register_cluster(layout)


def _sacctmgr(layout: Layout, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sacctmgr", "-i", "-n", *args], capture_output=True, text=True, timeout=60,
                          env=client_env(layout))


def _register_cluster(layout: Layout) -> None:
    res = _sacctmgr(layout, "list", "cluster", "format=cluster%40")
    if res.returncode != 0:
        log = layout.log_file("slurmdbd")
        raise DaemonError(f"sacctmgr cannot reach slurmdbd: {res.stderr.strip()}\n"
                          f"  slurmdbd log {log} (last lines):\n{tail(log)}")
    if CLUSTER_NAME in res.stdout.split():
        return
    res = _sacctmgr(layout, "add", "cluster", CLUSTER_NAME)
    if res.returncode != 0:
        raise DaemonError(f"sacctmgr add cluster {CLUSTER_NAME} failed: {res.stderr.strip() or res.stdout}")
