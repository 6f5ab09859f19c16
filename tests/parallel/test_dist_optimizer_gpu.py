"""The shard collectives on NCCL (its native reduce_scatter_tensor / all_gather_into_tensor, async, output
aliasing the input) agree with the emulated path and with the arithmetic. Needs 2 GPUs (skipped
otherwise; the gloo versions run in test_dist_optimizer.py). Not yet run: no GPU machine was lent."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests import accel as A
from tests.parallel import dopt_jobs as J
from tests.parallel import harness as H

pytestmark = A.min_gpus(2)  # an NCCL group of two ranks: one GPU each


def _worker(rank: int, port: int, out: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    from trainer.parallel import ParallelState, comm

    try:
        pstate = ParallelState.build(1, 1, [0, 1], device=f"cuda:{rank}")
        g, results = pstate.dp_group, {}
        for dtype in (torch.float32, torch.bfloat16):
            for emulate in (False, True):
                x = J.contribution(g.index, dtype).cuda()
                comm.reduce_scatter_shard(x, g, async_op=True, emulate=emulate).wait()
                start, end = comm.shard_range(x.numel(), g.size, g.index)
                y = torch.full_like(x, -1.0)
                y[start:end] = x[start:end]
                comm.all_gather_shard(y, g, async_op=True, emulate=emulate).wait()
                results[(str(dtype), emulate)] = (x[start:end].cpu(), y.cpu())
        torch.save(results, os.path.join(out, f"nccl.{rank}.pt"))
        pstate.destroy()
    finally:
        dist.destroy_process_group()


def test_nccl_shard_collectives(tmp_path):
    mp.start_processes(_worker, args=(H.free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    for dtype in (torch.float32, torch.bfloat16):
        total = J.contribution(0, dtype).float() + J.contribution(1, dtype).float()
        for rank in range(2):
            rec = torch.load(Path(tmp_path, f"nccl.{rank}.pt"), weights_only=False)
            for emulate in (False, True):
                shard, gathered = rec[(str(dtype), emulate)]
                per = total.numel() // 2
                torch.testing.assert_close(shard.float(), total[rank * per:(rank + 1) * per])
                torch.testing.assert_close(gathered.float(), total)
