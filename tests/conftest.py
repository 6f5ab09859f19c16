"""Shared test policy.

- ``gpu`` tests run only where CUDA is present; with ``SLIPWAY_GPU_REHEARSAL=1`` on a machine without
  CUDA, those that take the ``accel`` fixture run on the CPU with gloo instead (tests/accel.py), so the
  GPU check (bench/gpu_check.sh) is rehearsed before device time is spent. ``min_gpus(n)`` skips a test
  where fewer than n devices are present.
- ``slurm`` tests need the devcluster (``slurm/devcluster up``; ``make test`` brings it up). Locally a
  missing cluster skips them; with CI set (``1``/``true``/``yes``; ``.ci/run`` sets it) a missing cluster
  fails every one of them, never a skip. ``tests/test_ci_guard.py`` proves the guard fires.

Markers are read with ``get_closest_marker`` (a marker, wherever it was applied), never from
``item.keywords``, where any test or class *name* containing "slurm" would count as the marker.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.ci import IN_CI
from tests.mcore.harness import mcore_version  # noqa: F401 (the oracle's one version fixture)

_UNCHECKED = object()
_slurm_problem: object = _UNCHECKED


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def devcluster_problem() -> str | None:
    """None when the devcluster answers, else why not."""
    if not os.environ.get("SLURM_CONF"):
        return "SLURM_CONF is not set (run: eval \"$(slurm/devcluster up)\")"
    if not os.path.isfile(os.environ["SLURM_CONF"]):  # sinfo would spend its whole timeout on it
        return f"SLURM_CONF={os.environ['SLURM_CONF']} does not exist (run: eval \"$(slurm/devcluster up)\")"
    if shutil.which("sinfo") is None:
        return "sinfo not found (slurm-wlm not installed; slurm/devcluster up installs it)"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%N %t"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo timed out: slurmctld not answering"
    if out.returncode != 0:
        return f"sinfo failed: {out.stderr.strip()}"
    return None


def _cached_devcluster_problem() -> str | None:
    """Asked once per session (sinfo against a dead controller can take its whole timeout)."""
    global _slurm_problem
    if _slurm_problem is _UNCHECKED:
        _slurm_problem = devcluster_problem()
    return _slurm_problem  # type: ignore[return-value]


def pytest_collection_modifyitems(config, items):
    marked = [i for i in items if i.get_closest_marker("gpu") or i.get_closest_marker("min_gpus")]
    if not marked:
        return
    from tests import accel as A  # imports torch: only where torch-using gpu tests were collected

    has_cuda, rehearse = _cuda(), A.rehearsal()
    for item in marked:
        if item.get_closest_marker("gpu") is not None and not has_cuda:
            if not (rehearse and "accel" in item.fixturenames):
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
                continue
        need = item.get_closest_marker("min_gpus")
        if need is not None and A.device_count() < need.args[0]:
            item.add_marker(pytest.mark.skip(reason=f"needs {need.args[0]} GPUs, {A.device_count()} present"))


@pytest.fixture(scope="session")
def accel():
    """The device and process-group backend of a gpu test: CUDA/NCCL, or CPU/gloo in a rehearsal."""
    from tests import accel as A

    return A.accel()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """The devcluster guard. A setup hook rather than an autouse fixture: it runs before every fixture
    of the test, session- and module-scoped ones included, so no fixture submits jobs (or concludes from
    an unreachable Slurm that nothing was submitted) before the guard has spoken. A marker added at
    collection time cannot request a fixture (pytest fixes a test's fixtures when it collects it)."""
    if item.get_closest_marker("slurm") is None:
        return
    problem = _cached_devcluster_problem()
    if problem is None:
        return
    if IN_CI:
        pytest.fail(f"CI is set, so the devcluster is required, but: {problem}", pytrace=False)
    pytest.skip(f"devcluster not available: {problem}")


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test gets the environment it started with back. Code under test may export variables into
    its own process (submitit's TorchDistributedEnvironment().export() sets MASTER_ADDR, RANK, ... when a
    stage runs in-process); left behind, they reach every later job this process submits to Slurm, whose
    own export then refuses ('MASTER_ADDR is already set')."""
    before = dict(os.environ)
    yield
    for name in set(os.environ) - set(before) - {"PYTEST_CURRENT_TEST"}:  # pytest's own, set per phase
        del os.environ[name]
    for name, value in before.items():
        if os.environ.get(name) != value and name != "PYTEST_CURRENT_TEST":
            os.environ[name] = value
