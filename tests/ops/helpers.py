"""Shared pieces of the kernel tests: devices, dtypes and the stated tolerances."""

from __future__ import annotations

import pytest
import torch

from trainer.ops.selfcheck_cases import TOLERANCES

# Every op runs on CPU here; the same tests run on CUDA where a GPU is present (marker `gpu`).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# Tolerances against the eager reference evaluated in fp32 on the same (low-precision) inputs: the table
# the start-up self-check uses (trainer/ops/selfcheck_cases.py says why these values).
TOL = {dtype: dict(rtol=rtol, atol=atol) for dtype, (rtol, atol) in TOLERANCES.items()}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                 scale: float = 1.0) -> None:
    """actual ≈ expected (compared in fp32) within TOL[dtype]; atol grows with the reference's magnitude."""
    tol = TOL[dtype]
    mag = max(1.0, float(expected.detach().abs().max())) if expected.numel() else 1.0
    torch.testing.assert_close(actual.detach().float(), expected.detach().float(), rtol=tol["rtol"],
                               atol=tol["atol"] * mag * scale)


def rand(shape, dtype, device, *, requires_grad: bool = False,
         gen: torch.Generator | None = None) -> torch.Tensor:
    t = torch.randn(shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous layout (every other column of a wider buffer)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    out = wide[..., ::2]
    assert not out.is_contiguous()
    return out
