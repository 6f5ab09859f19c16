"""Multi-tensor AdamW: one ``slipway::adamw_step_`` call updates every parameter of a group.

The math is ``torch.optim.AdamW``'s (decoupled weight decay, bias correction, same operation order):
``p ← p·(1 − lr·wd); m ← lerp(m, g, 1 − β1); v ← β2·v + (1 − β2)·g²;
p ← p − lr/(1 − β1^t) · m / (√v/√(1 − β2^t) + eps)``. The weights it updates are fp32 master weights;
when the model holds bf16/fp16 copies, the same pass writes the rounded result into them.
On CPU one call covers all tensors (chunks spread over the threads); on CUDA one kernel launch does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from trainer import extension as _ext


@dataclass(frozen=True)
class AdamWHyper:
    """Hyper-parameters of one AdamW step (one param group)."""

    lr: float
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_scale: float = 1.0  # multiplies grads first (1/loss_scale unscales fp16 grads in the same pass)

    def __post_init__(self) -> None:
        if not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0):
            raise ValueError(f"AdamWHyper: betas must be in [0, 1), got ({self.beta1}, {self.beta2})")
        if self.lr < 0.0 or self.eps <= 0.0 or self.weight_decay < 0.0:
            raise ValueError(f"AdamWHyper: need lr >= 0, eps > 0, weight_decay >= 0; got lr={self.lr}, "
                             f"eps={self.eps}, weight_decay={self.weight_decay}")


@dataclass
class AdamWTensors:
    """Parallel lists for one step: fp32 masters and state, grads, and optional low-precision model copies.

    ``model_params`` is empty when the masters *are* the model's parameters (fp32 params, autocast).
    """

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    model_params: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.params)
        lengths = [len(self.grads), len(self.exp_avgs), len(self.exp_avg_sqs)]
        if any(k != n for k in lengths) or (self.model_params and len(self.model_params) != n):
            raise ValueError(f"AdamWTensors: lists must have equal length; params={n}, grads/exp_avgs/"
                             f"exp_avg_sqs={lengths}, model_params={len(self.model_params)}")


def adamw_step(t: AdamWTensors, hp: AdamWHyper, step: int) -> None:
    """One fused AdamW step (``step`` counts from 1) over all tensors in ``t``, in place."""
    torch.ops.slipway.adamw_step_(t.params, t.grads, t.exp_avgs, t.exp_avg_sqs, t.model_params, hp.lr,
                                  hp.beta1, hp.beta2, hp.eps, hp.weight_decay, int(step), hp.grad_scale)


class FusedAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` semantics on the fused kernel, with fp32 master weights for bf16/fp16 params.

    Parameters that are not fp32 get an fp32 master copy in their state (``master``); the kernel updates
    the master and writes the rounded value back to the parameter in the same pass.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        if not _ext.load():
            raise RuntimeError("FusedAdamW needs the compiled extension trainer._C; run `make install` "
                               "or use torch.optim.AdamW")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _state_of(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        if not st:
            master = p.detach().float().clone() if p.dtype != torch.float32 else None
            ref = master if master is not None else p
            st.update(step=0, exp_avg=torch.zeros_like(ref, dtype=torch.float32),
                      exp_avg_sq=torch.zeros_like(ref, dtype=torch.float32))
            if master is not None:
                st["master"] = master
        return st

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            hp = AdamWHyper(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                            weight_decay=group["weight_decay"])
            buckets: dict[tuple[int, bool], AdamWTensors] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self._state_of(p)
                st["step"] += 1
                has_master = "master" in st
                b = buckets.setdefault((st["step"], has_master), AdamWTensors([], [], [], []))
                b.params.append(st["master"] if has_master else p)
                b.grads.append(p.grad)
                b.exp_avgs.append(st["exp_avg"])
                b.exp_avg_sqs.append(st["exp_avg_sq"])
                if has_master:
                    b.model_params.append(p)
            for (step, _), tensors in buckets.items():
                adamw_step(tensors, hp, step)
        return loss
