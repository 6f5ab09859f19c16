"""The distributed optimizer's checkpoint: ``distrib_optim.pt`` beside ``model_optim_rng.pt``.

As Megatron's, its content does not depend on dp: DP rank 0 of each (tp, pp) gathers the shards and
writes, per parameter *name* (this shard's local names, as ``param_names``), the full fp32 master
(``param``) and the Adam moments (``exp_avg``, ``exp_avg_sq``), plus the step count. The ``optimizer``
entry of ``model_optim_rng.pt`` then carries ``distributed: True`` and an empty torch-shaped ``state``.

So a checkpoint saved at one dp loads at any other, and across the option: :func:`load_optimizer` takes
either form (a torch optimizer's ``state`` indexed by ``param_names``, or this file) into either
optimizer. :class:`DistribSource` lets the (tp, pp) reshard path read this file's state (and the fp32
masters, more precise than a 16-bit ``model`` entry) by name, as it reads a plain optimizer's.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from trainer.checkpoint.files import CheckpointError, shard_dir_name
from trainer.checkpoint.protocol import load_file
from trainer.parallel.dist_optimizer import DISTRIB_FILE, DistributedOptimizer
from trainer.restore.reshard import SourceCheckpoint

if TYPE_CHECKING:
    from trainer.parallel.engine import ParallelModel

FORMAT = "slipway-distrib-optim/1"
KEYS = ("param", "exp_avg", "exp_avg_sq")


def is_distributed(opt: object) -> bool:
    return isinstance(opt, DistributedOptimizer)


def _gather(t: torch.Tensor, model: ParallelModel) -> torch.Tensor | None:
    """Every DP rank's shard ``t`` concatenated in rank order, on DP rank 0 (None elsewhere)."""
    group = model.pstate.dp_group
    if group.size == 1:
        return t
    root = group.ranks[0]
    parts = [torch.empty_like(t) for _ in range(group.size)] if group.index == 0 else None
    dist.gather(t.contiguous(), parts, dst=root, group=group.pg)
    return torch.cat(parts) if parts is not None else None


@torch.no_grad()
def gather_state(opt: DistributedOptimizer) -> dict | None:
    """Collective over the DP group: ``distrib_optim.pt``'s content on DP rank 0, None on the others."""
    model = opt.model
    name_of = {id(p): n for n, p in model.named_parameters()}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for sh in opt.shards:
        full = [_gather(t, model) for t in (sh.master, sh.exp_avg, sh.exp_avg_sq)]
        if full[0] is None:
            continue
        for p, off in zip(sh.bucket.params, sh.bucket.offsets, strict=True):
            state[name_of[id(p)]] = {k: f[off: off + p.numel()].view(p.shape).cpu().clone()
                                     for k, f in zip(KEYS, full, strict=True)}
    if model.pstate.dp_group.index != 0:
        return None
    return {"format": FORMAT, "step": opt.step_count, "dp_size": model.pstate.dp_size, "state": state}


def extra_files(optimizer: object) -> dict[str, dict]:
    """Collective: the files to write beside this rank's shard ({} unless distributed and DP rank 0)."""
    if not is_distributed(optimizer):
        return {}
    content = gather_state(optimizer)  # type: ignore[arg-type]
    return {} if content is None else {DISTRIB_FILE: content}


def _read(path: str) -> dict:
    content = load_file(path, mmap=True)  # each rank copies only its shard out of it
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not Slipway's distributed-optimizer state (Megatron-LM's own "
                              "distrib_optim.pt, per-bucket flat buffers, is not read): start from the "
                              "checkpoint's weights with checkpoint.load=model-only")
    return content


def read_beside(shard_file: str) -> dict | None:
    """``distrib_optim.pt`` of the shard folder holding ``shard_file``; None when it has none."""
    path = os.path.join(os.path.dirname(shard_file), DISTRIB_FILE)
    return _read(path) if os.path.isfile(path) else None


@torch.no_grad()
def load_state(opt: DistributedOptimizer, by_name: dict[str, dict], step: int) -> None:
    """This rank's shard of a by-name state (any dp); a missing ``param`` keeps the model's weights (a
    plain checkpoint's, just loaded). The 16-bit weights are re-cast from the masters, all-gathered."""
    model = opt.model
    name_of = {id(p): n for n, p in model.named_parameters()}
    for sh in opt.shards:
        offset_of = {id(q): off for q, off in zip(sh.bucket.params, sh.bucket.offsets, strict=True)}
        for p, lo, hi in model.grads.shard_segments(sh.bucket):
            name = name_of[id(p)]
            entry = by_name.get(name)
            if not entry or "exp_avg" not in entry:
                raise CheckpointError(f"the checkpoint's optimizer state has no moments for {name}; it "
                                      "does not match this model: load with checkpoint.load=model-only")
            a, b, src = lo - sh.start, hi - sh.start, slice(lo - offset_of[id(p)], hi - offset_of[id(p)])
            weights = entry.get("param", p.detach())
            sh.master[a:b].copy_(weights.reshape(-1)[src])
            sh.exp_avg[a:b].copy_(entry["exp_avg"].reshape(-1)[src])
            sh.exp_avg_sq[a:b].copy_(entry["exp_avg_sq"].reshape(-1)[src])
            if opt.low_precision:
                sh.params[lo:hi].copy_(sh.master[a:b])
    opt.step_count = int(step)
    opt.gather_params()


def step_of(entry: dict) -> int:
    s = entry.get("step", 0)
    return int(s.item()) if torch.is_tensor(s) else int(s)


def _torch_state(optimizer: torch.optim.Optimizer, names: list[str], by_name: dict[str, dict],
                 step: int) -> dict:
    """A torch optimizer's state dict from a by-name state (torch.optim keeps a tensor step, Slipway's
    FusedAdamW an int)."""
    sd = optimizer.state_dict()
    tensor_step = isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)
    sd["state"] = {i: {"step": torch.tensor(float(step)) if tensor_step else step,
                       "exp_avg": by_name[n]["exp_avg"].float(),
                       "exp_avg_sq": by_name[n]["exp_avg_sq"].float()}
                   for i, n in enumerate(names) if n in by_name}
    return sd


@torch.no_grad()
def load_optimizer(optimizer: object, saved: dict, names: list[str], distrib: dict | None,
                   model: ParallelModel, weights: dict[str, torch.Tensor]) -> None:
    """Restore ``optimizer`` (plain or distributed) from a shard's ``optimizer`` entry ``saved`` and its
    ``distrib_optim.pt`` content ``distrib`` (either may be the saved form); ``weights``: the shard's
    flat model entry (the masters of a plain checkpoint)."""
    if saved["optimizer"].get("distributed"):
        if distrib is None:
            raise CheckpointError(f"the checkpoint was saved with optim.distributed=true but its "
                                  f"{DISTRIB_FILE} is missing beside model_optim_rng.pt: it is incomplete; "
                                  "load another iteration, or its weights with checkpoint.load=model-only")
        by_name, step = distrib["state"], int(distrib["step"])
    elif "state" not in saved["optimizer"]:
        raise CheckpointError("the checkpoint's optimizer entry is not a torch optimizer's state (another "
                              "tool's optimizer?): start from its weights with checkpoint.load=model-only")
    else:
        state = saved["optimizer"]["state"]
        by_name = {n: {**state[i], "param": weights[n]} for i, n in enumerate(names) if i in state}
        step = max((step_of(e) for e in state.values()), default=0)
        if not is_distributed(optimizer):
            optimizer.load_state_dict(saved["optimizer"])  # type: ignore[attr-defined]
            return
    load_by_name(optimizer, names, by_name, step, model)


def load_by_name(optimizer: object, names: list[str], by_name: dict[str, dict], step: int,
                 model: ParallelModel) -> None:
    """A by-name state (``param`` optional) into either optimizer; a plain one also takes the fp32
    ``param`` as its weights (the masters are more precise than a 16-bit ``model`` entry)."""
    if is_distributed(optimizer):
        load_state(optimizer, by_name, step)  # type: ignore[arg-type]
        return
    optimizer.load_state_dict(_torch_state(optimizer, names, by_name, step))  # type: ignore[attr-defined]
    for n, p in model.named_parameters():
        if "param" in by_name.get(n, {}):
            p.copy_(by_name[n]["param"])


class DistribSource(SourceCheckpoint):
    """A saved iteration for the (tp, pp) reshard path that also reads ``distrib_optim.pt``: its moments
    (and the fp32 ``param`` masters, which replace a 16-bit ``model`` entry) by name."""

    def stage(self, pp_rank: int) -> list[dict]:
        fresh = pp_rank not in self._stages
        shards = super().stage(pp_rank)
        if fresh:
            for t, shard in enumerate(shards):
                folder = os.path.join(self.base, shard_dir_name(t, pp_rank, self.pp_size))
                path = os.path.join(folder, DISTRIB_FILE)
                if not os.path.isfile(path):
                    continue
                content = _read(path)
                for saved_name, entry in content["state"].items():
                    name = self.global_param_name(saved_name, pp_rank)
                    shard["moments"][name] = {**entry, "step": int(content["step"])}
                    shard["model"][name] = entry["param"]
        return shards


def load_resharded(optimizer: object, names: list[str], moments: dict[str, dict],
                   model: ParallelModel) -> None:
    """The reshard path's per-name state (trainer.restore.reshard.reshard_moments) into either
    optimizer; ``param`` entries (from :class:`DistribSource`) are masters, never optimizer state."""
    by_name = {n: m for n, m in moments.items() if m}
    if not by_name:
        return
    step = max(step_of(e) for e in by_name.values())
    if is_distributed(optimizer):
        load_state(optimizer, by_name, step)  # type: ignore[arg-type]
        return
    optimizer.load_state_dict(_torch_state(optimizer, names, by_name, step))  # type: ignore[attr-defined]
