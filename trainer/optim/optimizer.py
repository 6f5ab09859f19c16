"""AdamW with Megatron's defaults and parameter groups, and the choice of implementation.

Weight decay is not applied to biases and 1-D parameters (LayerNorm weights): Megatron's
``no_weight_decay_cond``. Groups carry ``wd_mult`` (0 or 1) so the LR scheduler can set the decay value.

Implementation by availability (``optim.impl: auto``): on CUDA, apex ``FusedAdam`` (adam_w_mode) when
importable (NGC images ship it), else ``torch.optim.AdamW(fused=True)``; on CPU, Slipway's multi-tensor
``FusedAdamW`` (``trainer.ops.adamw``, the csrc kernel) when the extension is built and ``kernels`` is not
``eager``, else torch's per-tensor loop (torch's own CPU default; on this machine its ``foreach`` path was
~3x slower than the loop and ~60x slower than the csrc kernel for a 23M-parameter model). All are the same
AdamW update (decoupled decay, bias correction); the choice is logged. ``optim.impl=csrc`` selects the
csrc kernel on CUDA too.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from trainer.log import get_logger

log = get_logger(__name__)


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron's rule: biases and 1-D parameters (norm weights) are not decayed."""
    return name.endswith(".bias") or param.dim() == 1


def param_groups(named_params: Iterable[tuple[str, torch.Tensor]]) -> list[dict]:
    """Two groups (decayed, not decayed) over the trainable parameters, in a stable order."""
    decay, no_decay = [], []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        (no_decay if no_weight_decay(name, p) else decay).append(p)
    groups = [{"params": decay, "wd_mult": 1.0, "lr_mult": 1.0},
              {"params": no_decay, "wd_mult": 0.0, "lr_mult": 1.0}]
    return [g for g in groups if g["params"]]


def _apex_fused_adam():
    try:
        from apex.optimizers import FusedAdam  # type: ignore[import-not-found]

        return FusedAdam
    except Exception:  # noqa: BLE001 - apex absent or built without its CUDA extension
        return None


def _csrc_adamw(device_type: str) -> bool:
    from trainer.ops import csrc_available

    return csrc_available(device_type)


def choose_impl(impl: str, device_type: str, kernels: str = "auto") -> str:
    """Resolve ``auto`` to a concrete implementation for the device, checking availability."""
    if impl == "auto":
        if device_type == "cuda":
            return "apex" if _apex_fused_adam() is not None else "torch_fused"
        return "csrc" if kernels != "eager" and _csrc_adamw(device_type) else "for_loop"
    if impl == "apex" and (device_type != "cuda" or _apex_fused_adam() is None):
        raise ValueError("optim.impl=apex needs CUDA and an importable apex.optimizers.FusedAdam; "
                         "use optim.impl=auto to fall back automatically")
    if impl == "torch_fused" and device_type != "cuda":
        raise ValueError("optim.impl=torch_fused runs on CUDA only here; use foreach (or auto) on CPU")
    if impl == "csrc" and not _csrc_adamw(device_type):
        raise ValueError(f"optim.impl=csrc: trainer._C has no {device_type} AdamW kernel in this build "
                         "(run `make install`); or use optim.impl=auto")
    return impl


def build_optimizer(named_params: Iterable[tuple[str, torch.Tensor]], optim, device_type: str,
                    kernels: str = "auto") -> tuple[torch.optim.Optimizer, str]:
    """AdamW over ``named_params`` from an ``OptimConfig`` slice; returns (optimizer, implementation).

    The learning rate and weight decay set here are placeholders: the scheduler sets both every step.
    """
    groups = param_groups(named_params)
    impl = choose_impl(optim.impl, device_type, kernels)
    betas = (optim.adam_beta1, optim.adam_beta2)
    common = dict(lr=optim.lr, betas=betas, eps=optim.adam_eps, weight_decay=optim.weight_decay)
    if impl == "apex":
        opt = _apex_fused_adam()(groups, adam_w_mode=True, **common)
    elif impl == "torch_fused":
        opt = torch.optim.AdamW(groups, fused=True, **common)
    elif impl == "csrc":
        from trainer.ops.adamw import FusedAdamW

        opt = FusedAdamW(groups, **common)
    elif impl == "foreach":
        opt = torch.optim.AdamW(groups, foreach=True, **common)
    else:
        opt = torch.optim.AdamW(groups, foreach=False, **common)
    n = sum(p.numel() for g in groups for p in g["params"])
    log.info("optimizer: AdamW (%s), %d parameters in %d tensors, betas=%s eps=%g", impl, n,
             sum(len(g["params"]) for g in groups), betas, optim.adam_eps)
    return opt, impl
