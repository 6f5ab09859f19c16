"""The API the training loop uses: build this rank's model, run a step, sync gradients, evaluate.

    pstate = init_distributed(pcfg)                        # trainer.parallel.launch (torchrun / Slurm / 1)
    model = build_model(gpt_cfg, pcfg, pstate, seed)       # ParallelModel: this rank's stage and shard
    opt = torch.optim.AdamW(model.parameters(), ...)       # ordinary optimizers work on the shard
    m = num_microbatches(global_batch, micro_batch, pstate.dp_size)
    for it in ...:
        batches = [...]   # m dicts {tokens [b,s], labels [b,s], loss_mask [b,s] (optional)}, all of one
                          # shape: this DP rank's micro-batches (DP rank r of micro-step j gets samples
                          # [(j·dp + r)·b, +b) of the global batch, Megatron's order); every TP and PP
                          # rank of one DP replica passes the same ones (first stage reads tokens, last
                          # stage labels and loss_mask)
        loss = train_step(model, batches)                  # zero grads, forward+backward, grad sync
        norm = clip_grad_norm(model, max_norm)             # global norm over tp/pp/dp, clips in place
        opt.step()                                         # do not zero_grad(set_to_none=True) in between
    val = eval_step(model, batches)

``train_step`` returns the loss (fp32 scalar: each micro-batch's masked mean, averaged over micro-batches
and DP ranks, as Megatron) on every rank and leaves fully synchronised gradients in ``.grad``
(``finish_grad_sync`` has run): averaged over DP, the sequence-parallel replicated
parameters summed over TP, the tied embedding summed between first and last stage. For fp16 loss scaling
set ``model.loss_scale``; the gradients are then scaled by it. For bf16 mixed precision set
``model.autocast = torch.bfloat16`` (parameters, gradients and loss stay fp32).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from trainer.config.model import ModelConfig, ParallelConfig
from trainer.model.gpt import GPT, masked_mean
from trainer.model.init import init_weights, materialize
from trainer.model.names import load_megatron_state_dict, megatron_state_dict
from trainer.model.recompute import NO_RECOMPUTE, Recompute
from trainer.model.recompute import apply as recompute_model
from trainer.ops import KernelSet, resolve
from trainer.parallel import comm
from trainer.parallel.apply import (
    apply_tensor_parallel,
    check_compatible,
    sequence_parallel_param_names,
    stage_spec,
    tp_partition_dims,
)
from trainer.parallel.data_parallel import GradBuffers
from trainer.parallel.interleaved import INTERLEAVED_SCHEDULES, RingP2P, interleaved_forward_only
from trainer.parallel.pipeline import P2P, SCHEDULES, forward_only
from trainer.parallel.random import RNGTracker, seed_everything
from trainer.parallel.state import ParallelState

Tensor = torch.Tensor
Batch = Mapping[str, Tensor]


class ParallelModel:
    """One rank's share of the GPT (``module``: its pipeline stage, TP-sharded) and what steps need.

    With interleaving (``pcfg.virtual_pp_size`` v > 1) the rank holds v stages, ``chunks`` (chunk c:
    ``sharding.stage_layers(..., chunk=c)``), and ``module`` is refused; the model's parameter names then
    carry global layer numbers, so that they are unique across chunks (with v = 1 they are the stage's
    own, local numbers, as in Megatron's checkpoint)."""

    def __init__(self, module: GPT | list[GPT], pstate: ParallelState, pcfg: ParallelConfig,
                 tracker: RNGTracker) -> None:
        self.chunks: list[GPT] = list(module) if isinstance(module, list) else [module]
        self.pstate, self.pcfg, self.tracker = pstate, pcfg, tracker
        own = (lambda chunk, n: chunk.global_name(n)) if len(self.chunks) > 1 else (lambda chunk, n: n)
        self.partition_dims = {own(chunk, n): d for chunk in self.chunks
                               for n, d in tp_partition_dims(chunk).items()}
        """Parameter name → dim split across TP (None: replicated); see formats.md §4."""
        self.sequence_parallel_params = []
        if pcfg.sequence_parallel and pstate.tp_size > 1:
            for chunk in self.chunks:
                named = dict(chunk.named_parameters())
                self.sequence_parallel_params += [named[n] for n in sequence_parallel_param_names(chunk)]
        # One set of buckets over all chunks: parameters in chunk order, so that the buckets (filled in
        # reverse) start with the last chunk, whose backwards finish first.
        self.grads = GradBuffers(self.parameters(), pstate.dp_group, pcfg.bucket_size_mb,
                                 pcfg.overlap_grad_reduce)
        self.loss_scale = 1.0
        """Multiplies the loss before backward (fp16 dynamic loss scaling); grads come out scaled."""
        self.autocast: torch.dtype | None = None
        """Run forwards under ``torch.autocast(device, autocast)`` (e.g. torch.bfloat16): mixed precision
        with fp32 parameters, gradients and loss."""
        self.p2p_class: type[P2P] = RingP2P if len(self.chunks) > 1 else P2P
        """The pipeline's point-to-point exchange (a subclass can instrument it, as bench/pipeline.py);
        interleaving needs the ring (``RingP2P``)."""
        self.activation_dtype = next(self.chunks[0].parameters()).dtype
        """dtype of the hidden states passed between pipeline stages without autocast: the parameters'
        (under ``autocast`` the stages pass the autocast dtype: the residual stream is in it)."""

    @property
    def module(self) -> GPT:
        """This rank's stage (without interleaving; with it, use ``chunks``)."""
        if len(self.chunks) > 1:
            raise AttributeError(f"this rank holds {len(self.chunks)} model chunks "
                                 "(parallel.virtual_pp_size > 1): use ParallelModel.chunks")
        return self.chunks[0]

    def global_name(self, name: str) -> str:
        """A name from :meth:`named_parameters` with a global layer number (with v > 1 it has one)."""
        return name if len(self.chunks) > 1 else self.chunks[0].global_name(name)

    def parameters(self) -> list[nn.Parameter]:
        return [p for chunk in self.chunks for p in chunk.parameters()]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        if len(self.chunks) == 1:
            return list(self.chunks[0].named_parameters())
        return [(chunk.global_name(n), p) for chunk in self.chunks for n, p in chunk.named_parameters()]

    def megatron_state_dict(self, chunk: int = 0) -> dict:
        """This rank's shard (of one chunk) in Megatron's nested ``model`` layout (trainer.model.names);
        layer numbers local to the chunk, as Megatron writes ``model0``, ``model1``, …"""
        return megatron_state_dict(self.chunks[chunk])

    def load_megatron_state_dict(self, nested: dict, chunk: int = 0) -> None:
        load_megatron_state_dict(self.chunks[chunk], nested)


def build_model(cfg: ModelConfig, pcfg: ParallelConfig, pstate: ParallelState, seed: int,
                dtype: torch.dtype = torch.float32, kernels: str | KernelSet = "auto",
                recompute: Recompute = NO_RECOMPUTE, init: bool = True) -> ParallelModel:
    """This rank's stage and TP shard, initialised from the full weights for ``seed`` (the same in every
    layout), on ``pstate.device`` with parameters (and gradients) in ``dtype``; also seeds the dropout
    RNGs (trainer.parallel.random). For bf16 training prefer fp32 parameters and ``model.autocast``.
    ``kernels``: the kernel set (the top-level ``kernels`` key, trainer.ops.resolve); ``recompute``: what
    to recompute in backward (trainer.model.recompute; the tracker's states are restored around it).
    ``init=False``: the parameters are left uninitialised, for a caller that loads every one of them next
    (a resume: the checkpoint's weights are loaded strictly, all or an error; initialising them first
    costs a full model's random numbers per rank, seconds at 300M parameters, for nothing)."""
    check_compatible(cfg, pcfg)
    if (pcfg.tp_size, pcfg.pp_size) != (pstate.tp_size, pstate.pp_size):
        raise ValueError(f"ParallelConfig tp={pcfg.tp_size}, pp={pcfg.pp_size} != ParallelState "
                         f"tp={pstate.tp_size}, pp={pstate.pp_size}")
    tracker = seed_everything(seed, pstate)
    # A mode is resolved here, outside the meta-device context; a KernelSet is used as given (the checked
    # set from trainer.ops.selfcheck).
    kernel_set = resolve(kernels, pstate.device.type) if isinstance(kernels, str) else kernels
    chunks = []
    for chunk in range(pcfg.virtual_pp_size):
        with torch.device("meta"):  # no memory until this rank's shard is materialised
            spec = stage_spec(pcfg.split(cfg.num_layers), pstate.pp_rank, chunk)
            module = GPT(cfg, spec, cfg.padded_vocab_size(pstate.tp_size), kernel_set)
            apply_tensor_parallel(module, pstate, pcfg.sequence_parallel, tracker)
        recompute_model(module, recompute, tracker)
        materialize(module, pstate.device, dtype)
        if init:
            init_weights(module, seed)
        chunks.append(module)
    return ParallelModel(chunks if len(chunks) > 1 else chunks[0], pstate, pcfg, tracker)


class _Runner:
    """Runs micro-batches through this stage's chunks for a schedule (trainer.parallel.pipeline.StageRunner,
    trainer.parallel.interleaved.ChunkRunner): each chunk takes the micro-batches in order."""

    def __init__(self, model: ParallelModel, batches: Sequence[Batch]) -> None:
        self.model, self.batches, self.m = model, batches, len(batches)
        self.losses: list[Tensor] = []
        self._forwards = [0] * len(model.chunks)
        self._backwards = [0] * len(model.chunks)

    def forward(self, x: Tensor | None, chunk: int = 0) -> Tensor:
        device, module = self.model.pstate.device, self.model.chunks[chunk]
        batch = self.batches[self._forwards[chunk]]
        self._forwards[chunk] += 1
        tokens = batch["tokens"].to(device) if module.stage.pre_process else None
        labels = batch["labels"].to(device) if module.stage.post_process else None
        precision = self.model.autocast
        with torch.autocast(device.type, dtype=precision) if precision else contextlib.nullcontext():
            y = module(tokens=tokens, hidden=x, labels=labels)
        if not module.stage.post_process:
            return y
        mask = batch.get("loss_mask")
        loss = masked_mean(y, None if mask is None else mask.to(device))
        self.losses.append(loss.detach())
        return loss / self.m  # each micro-batch's mean loss counts 1/m of the step's loss

    def backward(self, x: Tensor | None, y: Tensor, dy: Tensor | None, chunk: int = 0) -> Tensor | None:
        self._backwards[chunk] += 1
        # DP hooks fire on a chunk's last backward: its parameters' gradients are then final.
        self.model.grads.sync_enabled = self._backwards[chunk] == self.m
        if dy is None:
            torch.autograd.backward(y * self.model.loss_scale)
        else:
            torch.autograd.backward(y, grad_tensors=dy.to(y.dtype))
        return None if x is None else x.grad


def _p2p(model: ParallelModel, batches: Sequence[Batch]) -> P2P:
    b, s = batches[0]["tokens"].shape
    if model.pcfg.sequence_parallel and model.pstate.tp_size > 1:
        s //= model.pstate.tp_size
    # Under autocast the residual stream, hence every stage's output, is in the autocast dtype.
    dtype = model.autocast or model.activation_dtype
    return model.p2p_class(model.pstate, (s, b, model.chunks[0].cfg.hidden_size), dtype)


def _mean_loss(model: ParallelModel, losses: list[Tensor]) -> Tensor:
    """Mean over micro-batches (last stage), sent to every stage and averaged over DP ranks."""
    ps = model.pstate
    loss = torch.stack(losses).mean() if losses else torch.zeros((), device=ps.device)
    loss = comm.all_reduce(loss.float(), ps.pp_group)  # only the last stage contributes
    return comm.all_reduce(loss, ps.dp_group) / ps.dp_size


def train_step(model: ParallelModel, batches: Sequence[Batch]) -> Tensor:
    """Zero grads, forward+backward over ``batches`` with the configured schedule, sync grads; the loss."""
    if not batches:
        raise ValueError("train_step needs at least one micro-batch")
    model.grads.zero()
    for chunk in model.chunks:
        chunk.train()
    runner, v = _Runner(model, batches), len(model.chunks)
    if v > 1:
        INTERLEAVED_SCHEDULES[model.pcfg.schedule](runner, _p2p(model, batches), len(batches), v)
    else:
        SCHEDULES[model.pcfg.schedule](runner, _p2p(model, batches), len(batches))
    finish_grad_sync(model)
    return _mean_loss(model, runner.losses)


@torch.no_grad()
def eval_step(model: ParallelModel, batches: Sequence[Batch]) -> Tensor:
    """Mean loss over ``batches`` (and DP ranks) without dropout or gradients, on every rank."""
    was_training = model.chunks[0].training
    for chunk in model.chunks:
        chunk.eval()
    runner, v = _Runner(model, batches), len(model.chunks)
    if v > 1:
        interleaved_forward_only(runner, _p2p(model, batches), len(batches), v)
    else:
        forward_only(runner, _p2p(model, batches), len(batches))
    for chunk in model.chunks:
        chunk.train(was_training)
    return _mean_loss(model, runner.losses)


@torch.no_grad()
def finish_grad_sync(model: ParallelModel) -> None:
    """Complete gradient synchronisation after the last backward (train_step calls it)."""
    ps = model.pstate
    model.grads.finish()  # DP average (distributed optimizer: of this rank's shard only)
    if model.sequence_parallel_params:  # each TP rank saw only its positions: sum the partial grads
        # (sharded: TP ranks share one bucket layout, so their shards line up and the sum holds there)
        grads = [model.grads.main_grad(p) for p in model.sequence_parallel_params]
        flat = comm.all_reduce(torch.cat([g.reshape(-1) for g in grads]), ps.tp_group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))
    tied = model.chunks[0].cfg.tie_word_embeddings  # an untied head (output_layer) has no copy to sync
    if tied and ps.pp_size > 1 and (ps.is_first_stage or ps.is_last_stage):  # tied: first + last stage
        # (the first chunk of the first stage and the last chunk of the last stage). The stages' buckets
        # differ, so their DP shards do not line up: gather the full reduced gradient.
        weight = (model.chunks[-1].head_weight() if ps.is_last_stage
                  else model.chunks[0].embedding.word_embeddings.weight)
        comm.all_reduce(model.grads.gather_full(weight), ps.embedding_group)
