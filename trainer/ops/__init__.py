"""Python faces of the fused kernels (``csrc/``) and the dispatch between implementations.

``resolve(mode)`` returns a :class:`KernelSet` whose functions the model calls. Modes:
``eager`` (reference compositions), ``csrc`` (Slipway's compiled ops), ``apex``, ``compile``, ``auto``.
This module starts with the eager set; the compiled ops plug in here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from trainer.ops import reference

KERNEL_MODES = ("auto", "csrc", "apex", "eager", "compile")


@dataclass(frozen=True)
class KernelSet:
    """The ops the GPT uses, one callable each, plus the name of the implementation chosen for each."""

    bias_gelu: Callable
    bias_dropout_add: Callable
    scaled_causal_softmax: Callable
    layer_norm: Callable
    names: dict


def resolve(mode: str = "auto") -> KernelSet:
    """The kernel set for ``mode`` (one of KERNEL_MODES)."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels={mode!r} is not one of {KERNEL_MODES}; set `kernels` to one of them")
    return KernelSet(
        bias_gelu=reference.bias_gelu,
        bias_dropout_add=reference.bias_dropout_add,
        scaled_causal_softmax=reference.scaled_causal_softmax,
        layer_norm=reference.layer_norm,
        names={"bias_gelu": "eager", "bias_dropout_add": "eager", "scaled_causal_softmax": "eager",
               "layer_norm": "eager"},
    )
