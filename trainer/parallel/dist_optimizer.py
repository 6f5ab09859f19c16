"""The distributed optimizer (ZeRO-1, Megatron's ``--use-distributed-optimizer``): AdamW state sharded
over the data-parallel group.

Every DP rank keeps the whole model (parameters in flat per-bucket buffers, the same buckets as its
gradients, trainer.parallel.data_parallel) but owns only its shard of each bucket (``comm.shard_range``:
buckets padded to a multiple of dp, rank r owns ``[r·n/d, (r+1)·n/d)``; a parameter straddling a shard
boundary is split between two ranks). A step is then

1. backward: each bucket's gradients are reduce-scattered (averaged) as soon as they are complete,
   overlapped with the rest of backward exactly like the all-reduce they replace;
2. unscale, global norm and clipping over the shards (trainer.parallel.grad_norm: the sum of squares is
   all-reduced over dp as well as tp/pp, so an inf/nan on any DP rank skips the step on all);
3. AdamW on the flat shard only (``optim.impl`` csrc: Slipway's multi-tensor kernel over the shard's
   segments; for_loop/foreach: torch's AdamW math), weight decay per element by Megatron's
   ``no_weight_decay`` rule (the segments are grouped by their parameter's group);
4. the updated shards are all-gathered into every rank's parameter buffers.

Precision (Megatron's layout): fp32 keeps fp32 parameters — the shard of the parameter buffer *is* the
master — 4 + 4 + 8/d bytes per parameter; bf16/fp16 keep 16-bit parameters, fp32 gradient buffers (the
16-bit ``.grad`` of each micro-batch is folded into them by hook) and an fp32 master of the shard beside
the moments, 2 + 4 + 12/d (trainer.memory_formulas.state_bytes_per_param; measured by bench/dist_optim.py).
The master starts from the fp32 initialisation, so every precision starts from the same weights.

The LR scheduler drives it through ``param_groups`` (``lr``, ``weight_decay``, ``wd_mult``, ``lr_mult``)
like any torch optimizer; the checkpoint form (``distrib_optim.pt``, independent of dp) is
trainer.restore.distrib_optim's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from trainer.log import get_logger
from trainer.ops.adamw import AdamWHyper, AdamWTensors, adamw_step
from trainer.optim.optimizer import param_groups
from trainer.parallel import comm
from trainer.parallel.data_parallel import GradBuffers, _Bucket

if TYPE_CHECKING:
    from trainer.parallel.engine import ParallelModel

log = get_logger(__name__)

DISTRIB_FILE = "distrib_optim.pt"
"""Where the state goes in a checkpoint (beside model_optim_rng.pt; trainer.restore.distrib_optim)."""
DIST_IMPLS = ("csrc", "for_loop", "foreach")
"""optim.impl values the shard step can use (after ``auto`` is resolved)."""


@dataclass
class _Shard:
    """This rank's part ``[start, end)`` of one bucket, with the optimizer state for it."""

    bucket: _Bucket
    start: int
    end: int
    params: torch.Tensor  # the bucket's flat parameter buffer (model dtype); the parameters are views
    master: torch.Tensor  # fp32 [end - start]; for fp32 parameters a view of ``params``
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


@dataclass
class _Segments:
    """One param group's pieces of all shards, as parallel lists for the multi-tensor kernel."""

    masters: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    exp_avgs: list[torch.Tensor] = field(default_factory=list)
    exp_avg_sqs: list[torch.Tensor] = field(default_factory=list)
    model: list[torch.Tensor] = field(default_factory=list)  # 16-bit parameter pieces (else empty)


def resolve_impl(impl: str, device_type: str, kernels: str = "auto") -> str:
    """The shard step's implementation; refuses those that step whole parameters."""
    from trainer.ops import csrc_available

    if impl == "auto":
        return "csrc" if kernels != "eager" and csrc_available(device_type) else "for_loop"
    if impl not in DIST_IMPLS:
        raise ValueError(f"optim.impl={impl} cannot step the distributed optimizer's flat shards (apex "
                         "FusedAdam and torch's fused AdamW update whole parameters); with "
                         "optim.distributed=true set optim.impl to auto, csrc, foreach or for_loop")
    if impl == "csrc" and not csrc_available(device_type):
        raise ValueError(f"optim.impl=csrc: trainer._C has no {device_type} AdamW kernel in this build "
                         "(run `make install`); or use optim.impl=auto")
    return impl


def _flat_params(bucket: _Bucket, dtype: torch.dtype) -> torch.Tensor:
    """Move the bucket's parameters into one flat buffer of ``dtype`` (same layout as its gradients)."""
    flat = torch.zeros(bucket.buffer.numel(), dtype=dtype, device=bucket.buffer.device)
    for p, off in zip(bucket.params, bucket.offsets, strict=True):
        view = flat[off: off + p.numel()].view_as(p)
        view.copy_(p.detach())
        p.data = view
    return flat


@torch.no_grad()
def shard_model(model: ParallelModel, param_dtype: torch.dtype = torch.float32) -> list[_Shard]:
    """Re-lay ``model`` for the distributed optimizer: sharded fp32 gradient buckets, parameters in
    flat buffers of ``param_dtype``, and this rank's fp32 master and zeroed moments per bucket."""
    params, ps, pcfg = model.parameters(), model.pstate, model.pcfg
    low = param_dtype != torch.float32
    full32 = {id(p): p.detach().clone() for p in params} if low else {}
    model.grads.remove_hooks()
    for p in params:
        p.grad = None
        p.data = p.data.to(param_dtype)
    model.grads = GradBuffers(params, ps.dp_group, pcfg.bucket_size_mb, pcfg.overlap_grad_reduce,
                              shard=True, grad_dtype=torch.float32)
    model.activation_dtype = param_dtype  # stage outputs are in the parameters' dtype now
    shards = []
    for bucket in model.grads.buckets:
        flat = _flat_params(bucket, param_dtype)
        start, end = model.grads.shard_range(bucket)
        if low:
            master = torch.zeros(end - start, dtype=torch.float32, device=flat.device)
            offset_of = {id(q): off for q, off in zip(bucket.params, bucket.offsets, strict=True)}
            for p, lo, hi in model.grads.shard_segments(bucket):
                off = offset_of[id(p)]
                master[lo - start: hi - start] = full32[id(p)].reshape(-1)[lo - off: hi - off]
        else:
            master = flat[start:end]
        shards.append(_Shard(bucket, start, end, flat, master, torch.zeros_like(master),
                             torch.zeros_like(master)))
    model.grads.zero()  # re-attach .grad (fp32) or free it (16-bit): the old buffers are released
    return shards


class DistributedOptimizer:
    """AdamW over this rank's shards (see the module docstring); ``param_groups`` as torch's."""

    def __init__(self, model: ParallelModel, optim, impl: str, param_dtype: torch.dtype = torch.float32,
                 groups: list[dict] | None = None) -> None:
        """``optim``: an OptimConfig slice (lr, weight_decay, betas, eps); ``groups``: parameter groups
        (default Megatron's decay / no-decay split, trainer.optim.optimizer.param_groups)."""
        self.model, self.impl = model, impl
        self.shards = shard_model(model, param_dtype)
        self.low_precision = param_dtype != torch.float32
        betas = (optim.adam_beta1, optim.adam_beta2)
        self.param_groups = [dict(g, lr=optim.lr, weight_decay=optim.weight_decay * g.get("wd_mult", 1.0),
                                  betas=betas, eps=optim.adam_eps)
                             for g in (groups or param_groups(model.named_parameters()))]
        self.step_count = 0
        self._segments = self._group_segments()
        log.info("optimizer: distributed AdamW (ZeRO-1) over dp=%d, shard step %s (%s), parameters %s, "
                 "%d of %d parameter elements owned here", model.pstate.dp_size, impl,
                 "csrc multi-tensor kernel" if impl == "csrc" else "torch AdamW math",
                 str(param_dtype).removeprefix("torch."), sum(s.end - s.start for s in self.shards),
                 sum(p.numel() for p in model.parameters()))

    def _group_segments(self) -> list[_Segments]:
        group_of = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        segs = [_Segments() for _ in self.param_groups]
        for sh in self.shards:
            for p, lo, hi in self.model.grads.shard_segments(sh.bucket):
                if id(p) not in group_of:
                    continue  # not trainable
                s, a, b = segs[group_of[id(p)]], lo - sh.start, hi - sh.start
                s.masters.append(sh.master[a:b])
                s.grads.append(sh.bucket.buffer[lo:hi])
                s.exp_avgs.append(sh.exp_avg[a:b])
                s.exp_avg_sqs.append(sh.exp_avg_sq[a:b])
                if self.low_precision:
                    s.model.append(sh.params[lo:hi])
        return segs

    @torch.no_grad()
    def step(self, closure=None):
        """AdamW on the shards, then all-gather the updated parameters (call after grad sync/clipping)."""
        self.step_count += 1
        for group, seg in zip(self.param_groups, self._segments, strict=True):
            if not seg.masters:
                continue
            beta1, beta2 = group["betas"]
            hp = AdamWHyper(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                            weight_decay=group["weight_decay"])
            if self.impl == "csrc":
                adamw_step(AdamWTensors(seg.masters, seg.grads, seg.exp_avgs, seg.exp_avg_sqs, seg.model),
                           hp, self.step_count)
            else:
                _torch_adamw(seg, hp, self.step_count)
        self.gather_params()

    def gather_params(self) -> None:
        """Every rank's updated shard into every rank's parameter buffers (launched together, then
        waited for: the buckets' all-gathers overlap each other)."""
        group = self.model.pstate.dp_group
        works = [comm.all_gather_shard(sh.params, group) for sh in self.shards]
        for w in works:
            w.wait()

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Masters from the model's weights, after weights were loaded into the model alone (a
        model-only or resharded start: Megatron's ``reload_model_params``; 16-bit weights give
        16-bit-exact masters). fp32: the master is the weights' own shard, nothing to do."""
        if not self.low_precision:
            return
        for sh in self.shards:
            sh.master.copy_(sh.params[sh.start:sh.end])

    def zero_grad(self, set_to_none: bool = False) -> None:
        self.model.grads.zero()  # gradients live in the buckets; never dropped

    def state_dict(self) -> dict:
        """What ``model_optim_rng.pt`` records: the state itself is in ``distrib_optim.pt``
        (trainer.restore.distrib_optim); the empty ``state`` keeps torch-shaped readers working."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"state": {}, "param_groups": groups, "distributed": True, "file": DISTRIB_FILE,
                "step": self.step_count}


@torch.no_grad()
def _torch_adamw(seg: _Segments, hp: AdamWHyper, step: int) -> None:
    """torch.optim.AdamW's single-tensor math (decoupled decay, bias correction) on each segment."""
    bc1, bc2 = 1 - hp.beta1**step, 1 - hp.beta2**step
    for i, (p, g, m, v) in enumerate(zip(seg.masters, seg.grads, seg.exp_avgs, seg.exp_avg_sqs,
                                         strict=True)):
        p.mul_(1 - hp.lr * hp.weight_decay)
        m.lerp_(g, 1 - hp.beta1)
        v.mul_(hp.beta2).addcmul_(g, g, value=1 - hp.beta2)
        p.addcdiv_(m, (v.sqrt() / math.sqrt(bc2)).add_(hp.eps), value=-hp.lr / bc1)
        if seg.model:
            seg.model[i].copy_(p)


def build_distributed_optimizer(model: ParallelModel, optim, precision: str, kernels: str = "auto"
                                ) -> tuple[DistributedOptimizer, str]:
    """From an OptimConfig slice and ``train.precision``: the optimizer and the implementation used."""
    from trainer.optim.precision import param_dtype

    impl = resolve_impl(optim.impl, model.pstate.device.type, kernels)
    return DistributedOptimizer(model, optim, impl, param_dtype(precision, True)), impl
