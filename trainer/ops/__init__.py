"""Python faces of the fused kernels (``csrc/``) and the one dispatch between implementations.

``resolve(mode, device_type)`` returns a :class:`KernelSet` whose functions the model calls. Modes
(config key ``kernels``):

- ``eager``: the reference compositions in :mod:`trainer.ops.reference`.
- ``csrc``: Slipway's compiled ops (``torch.ops.slipway.*``; CPU and, in CUDA builds, CUDA kernels).
- ``apex``: apex's kernel where apex has one for the op (LayerNorm, masked softmax), else csrc.
- ``compile``: ``torch.compile`` of each reference composition.
- ``auto``: per op, apex when importable on CUDA, else csrc, else eager.
- ``compile_layer``: csrc's set (else eager) with ``compile_layers`` on: each transformer layer runs the
  reference ops inside one ``torch.compile`` region (trainer.model.gpt), so Inductor fuses across them;
  the ops outside a layer (final norm, loss, AdamW) are csrc's.

A missing extension (or one built without CUDA kernels, used on CUDA) falls back to eager with one
clear warning; ``tests/ops/test_dispatch.py`` asserts the extension is built and chosen so the fallback
cannot hide a broken build. Attention itself goes through SDPA in the model; ``scaled_causal_softmax``
serves only the explicit-softmax attention path. The choice per op is logged once per (mode, device).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from trainer import extension as _ext
from trainer.config import KERNEL_SETS
from trainer.log import get_logger
from trainer.ops import reference

log = get_logger(__name__)

KERNEL_MODES = KERNEL_SETS  # the `kernels` key's values: defined once, with the config
OPS = ("bias_gelu", "bias_dropout_add", "scaled_causal_softmax", "layer_norm", "cross_entropy", "adamw_step",
       "rms_norm", "swiglu", "rotary")
_LOGGED: set[tuple[str, str]] = set()
_WARNED: set[str] = set()


@dataclass(frozen=True)
class KernelSet:
    """The ops the GPT uses, one callable each, plus the implementation chosen for each (``names``).

    Signatures are those of :mod:`trainer.ops.reference`: ``bias_gelu(x, bias)``,
    ``bias_dropout_add(x, bias, residual, p, training)``, ``scaled_causal_softmax(scores, scale)``,
    ``layer_norm(x, weight, bias, eps)``, ``cross_entropy(logits, target, vocab_size=None)`` (per-token
    fp32 loss of unsharded logits, the padded columns past ``vocab_size`` left out; the csrc loss writes
    its gradient over the logits; the vocab-parallel primitives are in :mod:`trainer.ops.cross_entropy`),
    ``adamw_step(tensors, hyper, step)`` (:mod:`trainer.ops.adamw`), and for Llama-style models
    ``rms_norm(x, weight, eps)``, ``swiglu(x)`` and ``rotary(x, cos, sin)``.
    """

    bias_gelu: Callable
    bias_dropout_add: Callable
    scaled_causal_softmax: Callable
    layer_norm: Callable
    cross_entropy: Callable = reference.cross_entropy
    adamw_step: Callable = reference.adamw_step
    rms_norm: Callable = reference.rms_norm
    swiglu: Callable = reference.swiglu
    rotary: Callable = reference.rotary
    names: dict = field(default_factory=dict)
    compile_layers: bool = False
    """kernels=compile_layer: the transformer layers run :func:`reference_set`'s ops, compiled whole."""


def reference_set() -> KernelSet:
    """Every op the eager reference (what a compiled region traces and fuses)."""
    return KernelSet(names=dict.fromkeys(OPS, "eager"), **{op: getattr(reference, op) for op in OPS})


def csrc_available(device_type: str) -> bool:
    """True when trainer._C loaded and has kernels for ``device_type`` ("cpu" or "cuda")."""
    if not _ext.load():
        return False
    key = "CUDA" if device_type == "cuda" else "CPU"
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(f"slipway::{op}", key)
               for op in ("bias_gelu", "layer_norm", "ce_local_stats", "adamw_step_", "rms_norm", "swiglu",
                          "rotary"))


def _csrc_table() -> dict[str, Callable]:
    from trainer.ops import adamw, cross_entropy, fused

    return {"bias_gelu": fused.bias_gelu, "bias_dropout_add": fused.bias_dropout_add,
            "scaled_causal_softmax": fused.scaled_causal_softmax, "layer_norm": fused.layer_norm,
            "cross_entropy": cross_entropy.head_loss, "adamw_step": adamw.adamw_step,
            "rms_norm": fused.rms_norm, "swiglu": fused.swiglu, "rotary": fused.rotary}


def _apex_table(fallbacks: dict[str, Callable]) -> dict[str, Callable]:
    from trainer.ops import apex_impl

    found = {"layer_norm": apex_impl.layer_norm(fallbacks["layer_norm"]),
             "scaled_causal_softmax": apex_impl.scaled_causal_softmax(fallbacks["scaled_causal_softmax"])}
    return {op: fn for op, fn in found.items() if fn is not None}


def _compile_table() -> dict[str, Callable]:
    # The optimizer step stays eager: compiling a per-parameter loop recompiles for every shape.
    return {op: torch.compile(getattr(reference, op), dynamic=True) for op in OPS if op != "adamw_step"}


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(message)


def _choose(mode: str, device_type: str) -> tuple[dict[str, Callable], dict[str, str]]:
    eager = {op: getattr(reference, op) for op in OPS}
    table, names = dict(eager), dict.fromkeys(OPS, "eager")
    if mode == "eager":
        return table, names
    if mode == "compile":
        for op, fn in _compile_table().items():
            table[op], names[op] = fn, "compile"
        return table, names
    if mode == "compile_layer":  # outside the compiled layers: csrc's ops (no apex)
        mode = "csrc"
    if csrc_available(device_type):
        for op, fn in _csrc_table().items():
            table[op], names[op] = fn, "csrc"
    elif _ext.load():
        # CPU kernels are always built, so a miss on CPU is a build older than csrc/ (an op added since).
        why = ("built without a CUDA toolkit/torch" if device_type == "cuda"
               else "built before some of csrc/'s ops were added")
        _warn_once(f"nocuda-{device_type}",
                   f"trainer._C has no {device_type.upper()} kernels for every op ({why}); kernels fall "
                   "back to eager. Fix: `make install` (for CUDA where nvcc and a CUDA torch are present).")
    if mode == "apex" or (mode == "auto" and device_type == "cuda"):
        for op, fn in _apex_table(dict(table)).items():
            table[op], names[op] = fn, "apex"
    return table, names


def resolve(mode: str = "auto", device_type: str | None = None) -> KernelSet:
    """The kernel set for ``mode`` (one of KERNEL_MODES) on ``device_type`` (default: cuda if available)."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels={mode!r} is not one of {KERNEL_MODES}; set `kernels` to one of them")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"resolve: device_type must be 'cpu' or 'cuda', got {device_type!r}")
    table, names = _choose(mode, device_type)
    layers = mode == "compile_layer"
    if (mode, device_type) not in _LOGGED:
        _LOGGED.add((mode, device_type))
        log.info("kernels=%s on %s: %s%s; attention uses SDPA (scaled_causal_softmax only on the explicit-"
                 "softmax path)", mode, device_type, ", ".join(f"{op}={names[op]}" for op in OPS),
                 "; transformer layers compiled whole from the reference ops" if layers else "")
    return KernelSet(names=names, compile_layers=layers, **table)
