"""Shared test policy.

- ``gpu`` tests run only where CUDA is present.
- ``slurm`` tests need the devcluster (``slurm/devcluster up``; ``make test`` brings it up). Locally a
  missing cluster skips them; with CI=true it is a failure, never a skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


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
    if shutil.which("sinfo") is None:
        return "sinfo not found (slurm-wlm not installed; slurm/devcluster up installs it)"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%N %t"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo timed out: slurmctld not answering"
    if out.returncode != 0:
        return f"sinfo failed: {out.stderr.strip()}"
    return None


def pytest_collection_modifyitems(config, items):
    has_cuda = _cuda()
    slurm_problem = None
    if any("slurm" in item.keywords for item in items):
        slurm_problem = devcluster_problem()
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "slurm" in item.keywords and slurm_problem:
            if IN_CI:
                item.add_marker(pytest.mark.usefixtures("_devcluster_required"))
            else:
                item.add_marker(pytest.mark.skip(reason=f"devcluster not available: {slurm_problem}"))


@pytest.fixture
def _devcluster_required():
    problem = devcluster_problem()
    if problem:
        pytest.fail(f"CI=true requires the devcluster, but: {problem}")
