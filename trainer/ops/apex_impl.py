"""Adapters to NVIDIA apex's fused kernels (present in NGC PyTorch images), used when ``kernels`` is
``apex`` or ``auto`` on CUDA. Apex covers LayerNorm and the upper-triangular masked softmax; the other
ops have no standalone apex kernel and resolve to csrc. (apex ``FusedAdam`` is an optimizer class:
``optim.impl=apex`` in trainer/optim/optimizer.py picks it.) Nothing here runs without apex and a GPU, so
it is kept to thin calls with shape/dtype guards that fall back to the next implementation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _import_layer_norm():
    from apex.normalization.fused_layer_norm import (  # type: ignore[import-not-found]
        fused_layer_norm_affine,
        mixed_dtype_fused_layer_norm_affine,
    )

    return fused_layer_norm_affine, mixed_dtype_fused_layer_norm_affine


def _import_softmax():
    from apex.transformer.functional.fused_softmax import (  # type: ignore[import-not-found]
        ScaledUpperTriangMaskedSoftmax,
    )

    return ScaledUpperTriangMaskedSoftmax


def layer_norm(fallback: Callable) -> Callable | None:
    """apex FusedLayerNorm as ``layer_norm(x, weight, bias, eps)``, or None when apex lacks it."""
    try:
        same, mixed = _import_layer_norm()
    except Exception:  # noqa: BLE001 - apex absent or built without its CUDA extensions
        return None

    def apex_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                        eps: float) -> torch.Tensor:
        if not x.is_cuda:
            return fallback(x, weight, bias, eps)
        shape = (x.shape[-1],)
        if x.dtype == weight.dtype:
            return same(x, weight, bias, shape, eps)
        if weight.dtype == torch.float32:  # low-precision activations, fp32 params: apex's mixed kernel
            return mixed(x, weight, bias, shape, eps)
        return fallback(x, weight, bias, eps)

    return apex_layer_norm


def scaled_causal_softmax(fallback: Callable) -> Callable | None:
    """apex's scaled upper-triangular masked softmax, for square fp16/bf16 scores it supports."""
    try:
        fn = _import_softmax()
    except Exception:  # noqa: BLE001
        return None

    def apex_softmax(scores: torch.Tensor, scale: float) -> torch.Tensor:
        sq, sk = scores.shape[-2], scores.shape[-1]
        ok = (scores.is_cuda and scores.dtype in (torch.float16, torch.bfloat16) and sq == sk
              and 16 < sk <= 2048 and sk % 8 == 0)
        if not ok:
            return fallback(scores, scale)
        return fn.apply(scores.reshape(-1, sq, sk), float(scale)).view(scores.shape)

    return apex_softmax
