"""Run a check against one installed megatron-core version, in a subprocess that has only that version on
``sys.path`` (versions cannot share one interpreter: they are all the package ``megatron``).

One worker process per version serves every check of that version (``python -m tests.mcore.checks
--serve``: one JSON request a line on stdin, the result on a sentinel line of stdout), so its interpreter
starts and imports torch and megatron-core once, not once per check (5-8 s each on CI's machine). At most
one worker is alive: asking for another version closes the previous one, and :func:`mcore_version`, the
session fixture every oracle test takes its version from, makes pytest run each version's tests of every
module together (tests/conftest.py imports it, so it is one fixture for the whole suite) and closes the
worker after them.

``versions`` is the pytest parameter list (ids ``mcore0.8.0`` …). A version that is not installed fails
under CI (``make test`` installs them) and is skipped locally with the command that installs it
(tests/ci.py's rule).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import tempfile

import pytest

from tests import ci
from tests.mcore.versions import RESULT, ROOT, VERSIONS, installed, interpreter, target

versions = [pytest.param(v, id=f"mcore{v}") for v in VERSIONS]


def require(version: str) -> None:
    if installed(version):
        return
    ci.skip_unless_ci(f"megatron-core {version} is not installed in {target(version)} (run: make mcore)")


class Worker:
    """``python -m tests.mcore.checks --serve`` under one version (its own session: a timeout ends the
    worker and the ranks it forked). stderr goes to a file (never a pipe nobody drains)."""

    def __init__(self, version: str) -> None:
        self.version = version
        # TORCHDYNAMO_DISABLE: from 0.10 Megatron's jit_fuser is torch.compile, which compiled its fused
        # activations anew in every forked rank of every job (2-3 s each on CPU); disabled, torch.compile
        # hands back the function itself, so Megatron's same fused-activation code runs eagerly.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target(version)), str(ROOT)]),
                   OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TORCHDYNAMO_DISABLE="1",
                   PYTHONUNBUFFERED="1")
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([str(interpreter(version)), "-m", "tests.mcore.checks", "--serve"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True, env=env, cwd=ROOT, start_new_session=True)

    def ask(self, check: str, kwargs: dict, timeout: float) -> dict:
        self.proc.stdin.write(json.dumps({"check": check, "kwargs": kwargs}) + "\n")
        self.proc.stdin.flush()
        seen: list[str] = []
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while True:
                if not sel.select(timeout):  # no line for `timeout` seconds
                    self.close()
                    raise AssertionError(self._failure(check, f"no answer in {timeout:.0f} s", seen))
                line = self.proc.stdout.readline()
                if not line:  # the worker died
                    self.proc.wait()
                    raise AssertionError(self._failure(check, f"exit {self.proc.returncode}", seen))
                if line.startswith(RESULT):
                    result = json.loads(line[len(RESULT):])
                    if "error" in result:
                        raise AssertionError(self._failure(check, "raised", seen, result["error"]))
                    return result
                seen = [*seen[-60:], line]

    def _failure(self, check: str, how: str, stdout: list[str], error: str = "") -> str:
        self.stderr.seek(0)
        return (f"megatron-core {self.version} check {check} failed ({how}):\n{''.join(stdout)[-3000:]}\n"
                f"{self.stderr.read()[-6000:]}\n{error[-6000:]}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.alive():
            try:
                self.proc.stdin.close()  # the worker exits at the end of its input
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.stderr.close()


_worker: Worker | None = None


def worker(version: str) -> Worker:
    """The live worker of ``version`` (another version's is closed first)."""
    global _worker
    if _worker is not None and (_worker.version != version or not _worker.alive()):
        _worker.close()
        _worker = None
    if _worker is None:
        _worker = Worker(version)
    return _worker


def close_worker() -> None:
    global _worker
    if _worker is not None:
        _worker.close()
        _worker = None


def run_check(version: str, check: str, timeout: float = 300, **kwargs) -> dict:
    """``tests.mcore.checks.<check>(**kwargs)`` under megatron-core ``version``; returns its JSON result.
    Arrays go through files the check writes (paths in ``kwargs``)."""
    require(version)
    result = worker(version).ask(check, kwargs, timeout)
    # the version on sys.path is the one asked for (0.18 appends the git hash of the cwd: +<commit>)
    assert result["megatron_core"].split("+")[0] == version, result
    return result


@pytest.fixture(scope="session", params=versions)
def mcore_version(request) -> str:
    """The megatron-core version of an oracle test; its worker is closed after that version's tests."""
    yield request.param
    close_worker()
