"""The interleaved schedule's NCCL path (RingP2P's batch_isend_irecv, activation ops posted before
gradient ops so that p=2's shared link pairs up): on 2 GPUs, one step at p=2, v=2, m=4 gives the
gradients of the all-forward-all-backward order and of a single-process CPU run. Skips without 2 GPUs
(NCCL refuses two ranks on one device)."""

from __future__ import annotations

import dataclasses
import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests import accel as A
from tests.parallel import harness as H
from trainer.parallel import ParallelConfig, ParallelState, build_model, train_step

pytestmark = A.min_gpus(2)  # NCCL p2p between two ranks: one GPU each

CFG = dataclasses.replace(H.CFG, num_layers=4)
M = 4


def _batches() -> list[dict[str, torch.Tensor]]:
    batch, b = H.global_batch(0), H.GLOBAL_BATCH // M
    return [{k: t[j * b:(j + 1) * b] for k, t in batch.items()} for j in range(M)]


def _worker(rank: int, port: int, outdir: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        pstate = ParallelState.build(1, 2, [0, 1], device=f"cuda:{rank}")
        out = {}
        for schedule in ("1f1b", "afab"):
            pcfg = ParallelConfig(pp_size=2, virtual_pp_size=2, schedule=schedule)
            model = build_model(CFG, pcfg, pstate, H.SEED, kernels="eager")
            train_step(model, _batches())
            out[schedule] = {n: p.grad.cpu() for n, p in model.named_parameters()}
        torch.save(out, os.path.join(outdir, f"nccl.{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_interleaved_nccl_gradients(tmp_path: Path):
    mp.start_processes(_worker, args=(H.free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    single = build_model(CFG, ParallelConfig(), ParallelState.single(), H.SEED, kernels="eager")
    train_step(single, _batches())
    ref = {single.global_name(n): p.grad for n, p in single.named_parameters()}
    for rank in range(2):
        rec = torch.load(tmp_path / f"nccl.{rank}.pt")
        for name, g in rec["1f1b"].items():
            torch.testing.assert_close(g, rec["afab"][name], rtol=1e-5, atol=1e-7, msg=name)
            torch.testing.assert_close(g, ref[H.EMB if name == H.HEAD else name], rtol=1e-3, atol=1e-5,
                                       msg=name)
