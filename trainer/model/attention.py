"""Which kernel SDPA runs (``model.sdpa_backend``), and the start-up line that says so.

``auto`` on CUDA ranks the kernels cuDNN > flash > memory-efficient > math and SDPA takes the first one
that supports the call: cuDNN attention (the fastest on Hopper) refuses attention dropout, so with
``model.attention_dropout`` > 0 training runs flash and evaluation (no dropout) cuDNN. ``auto`` on CPU
leaves the choice to torch (its flash kernel without dropout, else the math path, which materialises the
scores in fp32). A named kernel is the only one allowed: a call it cannot serve fails with torch's reason.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from trainer.config.model import SDPA_BACKENDS

_KERNELS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
CUDA_PRIORITY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH]
_NAMES = {v: k for k, v in _KERNELS.items()}


def sdpa_context(choice: str, device_type: str) -> contextlib.AbstractContextManager:
    """The context an SDPA call runs in for ``model.sdpa_backend=choice`` on ``device_type``."""
    if choice not in SDPA_BACKENDS:
        raise ValueError(f"model.sdpa_backend={choice!r} is not one of {SDPA_BACKENDS}")
    if choice == "auto":
        if device_type != "cuda":
            return contextlib.nullcontext()
        return sdpa_kernel(CUDA_PRIORITY, set_priority=True)
    return sdpa_kernel([_KERNELS[choice]])


def chosen_kernel(choice: str, device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int, int],
                  dropout: float, grad: bool) -> str:
    """The kernel SDPA picks for a causal call on q/k/v of ``shape`` [b, heads, s, d] (torch's own
    dispatch, ``torch._fused_sdp_choice``, under :func:`sdpa_context`); or why none can."""
    q = torch.zeros(shape, device=device, dtype=dtype, requires_grad=grad)
    try:
        with sdpa_context(choice, device.type):
            picked = SDPBackend(torch._fused_sdp_choice(q, q, q, None, dropout, True))
    except RuntimeError as e:
        return f"none ({str(e).splitlines()[0][:120]})"
    return _NAMES.get(picked, picked.name.lower())


def describe(cfg, device: torch.device, dtype: torch.dtype, micro_batch: int, tp: int = 1) -> str:
    """One start-up line: the attention path and, for SDPA, the kernel of training and of evaluation."""
    if cfg.attention_backend != "sdpa":
        return (f"attention: explicit softmax (the scaled causal softmax kernel, dropout "
                f"{cfg.attention_dropout}, probabilities materialised)")
    heads = max(cfg.num_attention_heads // tp, 1)
    shape = (min(micro_batch, 2), heads, min(cfg.seq_length, 256), cfg.head_dim)
    train = chosen_kernel(cfg.sdpa_backend, device, dtype, shape, cfg.attention_dropout, True)
    evaluate = chosen_kernel(cfg.sdpa_backend, device, dtype, shape, 0.0, False)
    if train.startswith("none") and cfg.sdpa_backend != "auto":
        raise ValueError(f"model.sdpa_backend={cfg.sdpa_backend} cannot run this model's attention on "
                         f"{device.type} ({str(dtype)[6:]}, head dim {cfg.head_dim}, dropout "
                         f"{cfg.attention_dropout}): {train[6:-1]}. Set model.sdpa_backend=auto")
    dropout = f"dropout {cfg.attention_dropout}" if cfg.attention_dropout else "no dropout"
    return (f"attention: SDPA, model.sdpa_backend={cfg.sdpa_backend} on {device.type} {str(dtype)[6:]}: "
            f"training ({dropout}) runs {train}, evaluation runs {evaluate}")
