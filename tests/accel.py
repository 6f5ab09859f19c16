"""Where the `gpu` tests beyond the kernels run, and how they are rehearsed without a GPU.

A GPU machine is lent to this project rarely and for minutes, so every `gpu` test that can is written
against the ``accel`` fixture (tests/conftest.py) instead of naming "cuda": on a CUDA machine it is
CUDA and NCCL; with ``SLIPWAY_GPU_REHEARSAL=1`` on a machine without one it is the CPU and gloo, so the
test's own code (configs, process launch, comparisons) runs here and a mistake in it costs no device
time. A rehearsal proves the test's plumbing, not the GPU's numbers. Tests that name "cuda" directly
(tests/ops, tests/eval) stay skipped in a rehearsal.

``min_gpus(n)`` marks a test that needs n devices (NCCL refuses two ranks on one GPU); under a
rehearsal gloo ranks stand in for them, so any n is available.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

REHEARSAL_ENV = "SLIPWAY_GPU_REHEARSAL"


def rehearsal() -> bool:
    """True when gpu tests should run on the CPU because no CUDA device is present."""
    return os.environ.get(REHEARSAL_ENV, "") == "1" and not torch.cuda.is_available()


@dataclass(frozen=True)
class Accel:
    """The device a gpu test runs on: ``device`` ("cuda" or, rehearsing, "cpu") and its process-group
    ``backend`` ("nccl" or "gloo")."""

    device: str
    backend: str

    @property
    def rehearsal(self) -> bool:
        return self.device == "cpu"


def accel() -> Accel:
    return Accel("cuda", "nccl") if torch.cuda.is_available() else Accel("cpu", "gloo")


def device_count() -> int:
    """CUDA devices here; under a rehearsal as many as a test asks for (they are gloo processes)."""
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return 1 << 10 if rehearsal() else 0


def min_gpus(n: int) -> list[pytest.MarkDecorator]:
    """Marks for a test that needs ``n`` GPUs: ``gpu`` plus ``min_gpus(n)`` (tests/conftest.py skips it
    where fewer are present, naming how many it needs and how many there are)."""
    return [pytest.mark.gpu, pytest.mark.min_gpus(n)]
