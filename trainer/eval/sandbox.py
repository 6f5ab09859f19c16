"""Running one model-written program, contained.

The programs are untrusted: a sampled completion can loop, allocate without bound, fork, write files,
open sockets or read the environment. Each runs in its own subprocess with

- a wall-clock limit (killed with its whole process group, and with its PID namespace where there is one)
  and RLIMIT_CPU, RLIMIT_AS (memory), RLIMIT_FSIZE (file size), RLIMIT_NPROC (processes), RLIMIT_NOFILE,
  no core dumps (set by ``prlimit`` before exec);
- an empty temporary working directory (the program comes on stdin) and ``python -I -S -B`` (no user
  site, no PYTHON* variables, no bytecode written);
- a clean environment: PATH, LANG and HOME only, so no secret of the job's reaches it;
- no network: a new network namespace (``unshare --net``), with a PID namespace and its own /proc (the
  program sees no other process, so not the job's /proc/PID/environ either), and as root a uid of its
  own (root ignores RLIMIT_NPROC, which counts a uid's processes machine-wide: programs sharing ``nobody``
  shared one budget, so a fork bomb made its neighbours fail to start). Where namespaces cannot be made
  (no ``unshare``, unprivileged user namespaces off) the program runs without them; :func:`isolation`
  says which level was reached and the results record it.

A time-out, a crash or any non-zero exit is a failed sample, never an error of the caller.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

NOBODY = 65534  # the probe's uid: it may execute what any unprivileged uid may
# Each program run as root gets a uid no other program runs as meanwhile (held by a lock file, so also
# across processes and jobs on this node), far above any account's; nothing is ever owned by it for long.
PRIVATE_UID_BASE = 2_000_000_000
PRIVATE_UID_SLOTS = 4096
_UID_LOCKS = os.path.join(tempfile.gettempdir(), "slipway-sandbox-uids")
STDERR_TAIL = 2000  # characters of a failed program's stderr kept (why it failed)
# Strongest first: (label, unshare arguments); "none" runs the program directly.
_LEVELS = (
    ("netns+pidns+procfs", ["--net", "--pid", "--fork", "--kill-child", "--mount-proc"]),
    ("netns+pidns", ["--net", "--pid", "--fork", "--kill-child"]),
    ("netns", ["--net"]),
)


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 3.0
    memory_mb: int = 1024
    file_size_mb: int = 16
    processes: int = 64  # RLIMIT_NPROC: the program's processes (each program has its own uid)
    open_files: int = 64


@dataclass(frozen=True)
class Outcome:
    passed: bool
    status: str  # passed | failed | timeout
    detail: str = ""  # the tail of stderr, or the exit status


def _candidates() -> list[tuple[str, list[str], str]]:
    """(label, unshare prefix, interpreter), strongest first. As root the program drops to a private uid
    (root ignores RLIMIT_NPROC; ``run_program`` adds the ``--setuid``), which needs an interpreter any uid
    may execute: this one, else the system's (HumanEval's programs need only the standard library); then
    root inside the namespaces."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    pythons = list(dict.fromkeys(p for p in (sys.executable, shutil.which("python3", path="/usr/bin:/bin"))
                                 if p))
    out = []
    for label, args in _LEVELS:
        if os.geteuid() == 0:
            out += [(f"{label}+uid", [unshare, *args], py) for py in pythons]
            out.append((f"{label}+root", [unshare, *args], sys.executable))
        else:
            out.append((f"{label}+userns", [unshare, "--map-root-user", *args], sys.executable))
    return out


@functools.lru_cache(maxsize=1)
def isolation() -> tuple[str, tuple[str, ...], str]:
    """(level, command prefix, interpreter): the strongest containment this machine lets us create,
    probed once."""
    for label, prefix, python in _candidates():
        drop = _drop(NOBODY) if label.endswith("+uid") else []
        try:
            probe = subprocess.run([*prefix, *drop, python, "-I", "-S", "-c", "pass"], capture_output=True,
                                   timeout=20, cwd="/", env=_clean_env("/"))
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return label, tuple(prefix), python
    return "none (no namespaces: the programs could reach the network)", (), sys.executable


def _drop(uid: int) -> list[str]:
    return ["--setuid", str(uid), "--setgid", str(uid)]


@contextlib.contextmanager
def _private_uid():
    """A uid that no other program is running as while the block runs (see PRIVATE_UID_BASE)."""
    os.makedirs(_UID_LOCKS, mode=0o700, exist_ok=True)
    first = os.getpid() % PRIVATE_UID_SLOTS  # spreads the processes' searches
    for i in range(PRIVATE_UID_SLOTS):
        uid = PRIVATE_UID_BASE + (first + i) % PRIVATE_UID_SLOTS
        fd = os.open(os.path.join(_UID_LOCKS, str(uid)), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when fd closes, even on a crash
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield uid
        finally:
            os.close(fd)
        return
    raise RuntimeError(f"all {PRIVATE_UID_SLOTS} sandbox uids from {PRIVATE_UID_BASE} are in use (locks in "
                       f"{_UID_LOCKS}): run fewer evaluation workers on this node")


def _clean_env(home: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": home}


def _limit_values(limits: Limits) -> list[tuple[str, int, int]]:
    """(prlimit flag, resource, value): soft = hard, so the program cannot raise them."""
    mb = 1024 * 1024
    return [("--cpu", resource.RLIMIT_CPU, int(limits.timeout_s) + 1),
            ("--as", resource.RLIMIT_AS, limits.memory_mb * mb),
            ("--fsize", resource.RLIMIT_FSIZE, limits.file_size_mb * mb), ("--core", resource.RLIMIT_CORE, 0),
            ("--nproc", resource.RLIMIT_NPROC, limits.processes),
            ("--nofile", resource.RLIMIT_NOFILE, limits.open_files)]


def _limits_prefix(limits: Limits) -> list[str]:
    """``prlimit`` (util-linux) sets the limits and execs the rest: no Python code between fork and exec
    in this multi-threaded process (a ``preexec_fn`` there can deadlock). [] where it is missing."""
    prlimit = shutil.which("prlimit")
    return [prlimit, *(f"{flag}={v}:{v}" for flag, _, v in _limit_values(limits)), "--"] if prlimit else []


def _set_limits(limits: Limits) -> None:
    """The fallback without prlimit: in the child before exec."""
    for _, what, value in _limit_values(limits):
        resource.setrlimit(what, (value, value))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass


def run_program(program: str, limits: Limits) -> Outcome:
    """Run ``program`` (Python source) contained; passed means exit status 0 within the time limit."""
    level, prefix, python = isolation()
    with tempfile.TemporaryDirectory(prefix="slipway-exec-") as work, \
            tempfile.TemporaryFile(mode="w+b") as err, \
            (_private_uid() if level.endswith("+uid") else contextlib.nullcontext()) as uid:
        drop = []
        if uid is not None:
            os.chown(work, uid, uid)  # the program runs as its own uid; its directory is its own
            drop = _drop(uid)
        limit = _limits_prefix(limits)
        proc = subprocess.Popen(
            [*limit, *prefix, *drop, python, "-I", "-S", "-B", "-"], cwd=work, env=_clean_env(work),
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
            preexec_fn=None if limit else functools.partial(_set_limits, limits))
        try:
            proc.communicate(program.encode(), timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.wait()
            return Outcome(False, "timeout", f"killed after {limits.timeout_s:g} s")
        except BrokenPipeError:  # the program exited before reading all of itself (a limit hit at start)
            proc.wait()
        finally:
            _kill_group(proc)  # anything it left behind in its session (no PID namespace)
        err.seek(0)
        tail = err.read()[-STDERR_TAIL:].decode("utf-8", errors="replace")
    if proc.returncode == 0:
        return Outcome(True, "passed")
    last = tail.strip().splitlines()[-1] if tail.strip() else f"exit status {proc.returncode}"
    return Outcome(False, "failed", last)
