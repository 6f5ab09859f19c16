"""Run a check against one installed megatron-core version, in a subprocess that has only that version on
``sys.path`` (versions cannot share one interpreter: they are all the package ``megatron``).

``versions`` is the pytest parameter list (ids ``mcore0.8.0`` …). A version that is not installed fails
under CI (``make test`` installs them) and is skipped locally with the command that installs it
(tests/ci.py's rule).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests import ci
from tests.mcore.versions import ROOT, VERSIONS, installed, interpreter, target

versions = [pytest.param(v, id=f"mcore{v}") for v in VERSIONS]


def require(version: str) -> None:
    if installed(version):
        return
    ci.skip_unless_ci(f"megatron-core {version} is not installed in {target(version)} (run: make mcore)")


def run_check(version: str, check: str, timeout: float = 300, **kwargs) -> dict:
    """``tests.mcore.checks.<check>(**kwargs)`` under megatron-core ``version``; returns its JSON result.
    Arrays go through files the check writes (paths in ``kwargs``)."""
    require(version)
    # TORCHDYNAMO_DISABLE: from 0.10 Megatron's jit_fuser is torch.compile, which compiled its fused
    # activations anew in every forked rank of every job (2-3 s each on CPU); disabled, torch.compile
    # hands back the function itself, so Megatron's same fused-activation code runs eagerly.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target(version)), str(ROOT)]),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TORCHDYNAMO_DISABLE="1")
    proc = subprocess.run([str(interpreter(version)), "-m", "tests.mcore.checks", check, json.dumps(kwargs)],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(f"megatron-core {version} check {check} failed (exit {proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # the version on sys.path is the one asked for (0.18 appends the git hash of the cwd: +<commit>)
    assert result["megatron_core"].split("+")[0] == version, result
    return result
