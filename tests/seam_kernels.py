"""The kernel faults of the test seam (tests/seam.py): ``SLIPWAY_KERNEL_FAULT=op[:kind],...`` makes a resolved
op wrong, as a miscompiled or mismatched kernel would be (the kernel self-check's tests). Kinds: ``value``
(default; the output 25 % too large, so its gradients too; for ``adamw_step`` the updated weights), ``grad``
(the gradient flowing back 25 % too large), ``raise`` (as a CUDA kernel built for another GPU does). The
faulty op's implementation name gains ``+fault``, so even a ``kernels=eager`` run has it checked."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

from trainer.faults import KERNEL_FAULT
from trainer.ops import OPS, KernelSet

KINDS = ("value", "grad", "raise")
_FACTOR = 1.25


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * _FACTOR


def _wrong(op: str, fn: Callable, kind: str) -> Callable:
    def wrong(*args, **kwargs):
        if kind == "raise":
            raise RuntimeError(f"CUDA error: no kernel image is available for execution on the device "
                               f"({KERNEL_FAULT}: {op} made to raise)")
        out = fn(*args, **kwargs)
        if op == "adamw_step":  # in place: the updated masters are wrong
            with torch.no_grad():
                for p in args[0].params:
                    p.mul_(_FACTOR)
            return out
        return out * _FACTOR if kind == "value" else _ScaleGrad.apply(out)

    return wrong


def parse(value: str) -> dict[str, str]:
    """``op[:kind],...`` → {op: kind}; raises ValueError naming what is wrong."""
    faults = {}
    for item in filter(None, (x.strip() for x in value.split(","))):
        op, _, kind = item.partition(":")
        kind = kind or "value"
        ops = OPS if op == "all" else (op,)
        if op != "all" and op not in OPS or kind not in KINDS:
            raise ValueError(f"{KERNEL_FAULT}={value!r}: {item!r} is not op[:kind] with op in {OPS} or 'all' "
                             f"and kind in {KINDS}; unset {KERNEL_FAULT} (it is a test hook)")
        faults.update(dict.fromkeys(ops, kind))
    return faults


def inject(kernels: KernelSet, environ: Mapping[str, str]) -> KernelSet:
    """``kernels`` with the faults ``environ[KERNEL_FAULT]`` asks for (unchanged when it is unset)."""
    faults = parse(environ.get(KERNEL_FAULT, ""))
    if not faults:
        return kernels
    names = {**kernels.names, **{op: f"{kernels.names[op]}+fault" for op in faults}}
    return dataclasses.replace(kernels, names=names,
                               **{op: _wrong(op, getattr(kernels, op), kind) for op, kind in faults.items()})
