"""Bytes per parameter of the training state with and without the distributed optimizer, measured.

For dp = 1, 2, 4 (gloo worlds on CPU) and fp32 / bf16, with optim.distributed off and on: build the
model, take one optimizer step (so lazily created state exists), and count what one rank holds by its
tensors' storages (bench.counters: weights, gradient buffers, optimizer state incl. fp32
masters), next to ``trainer.memory_formulas.state_bytes_per_param`` (Megatron's table: fp32 4 + 4 + 8/d, bf16
2 + 4 + 12/d; 16 without the option). The only expected difference is each bucket's padding to a
multiple of dp (under dp elements per bucket).

    python bench/dist_optim.py [--out bench/results/dist_optim.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.counters import measure_state_bytes  # noqa: E402
from bench.meta import run_meta  # noqa: E402
from trainer.config import OptimConfig  # noqa: E402
from trainer.config.model import ModelConfig  # noqa: E402
from trainer.memory_formulas import state_bytes_per_param  # noqa: E402
from trainer.ops.dtypes import DTYPES  # noqa: E402
from trainer.optim.optimizer import build_optimizer  # noqa: E402
from trainer.parallel import (  # noqa: E402
    ParallelConfig,
    ParallelState,
    build_model,
    clip_grad_norm,
    train_step,
)
from trainer.parallel.dist_optimizer import DistributedOptimizer  # noqa: E402

BENCH_CFG = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=32, vocab_size=1024,
                      hidden_dropout=0.0, attention_dropout=0.0)
PRECISIONS = ("fp32", "bf16")  # the rows of Megatron's table (fp16 keeps what bf16 does)


def measure(pstate: ParallelState, cfg: ModelConfig, precision: str, distributed: bool) -> dict:
    """One row: build, one step, count this rank's bytes per parameter."""
    model = build_model(cfg, ParallelConfig(), pstate, 1234, kernels="csrc")
    optim = OptimConfig(lr=1e-3)
    if precision != "fp32":
        model.autocast = DTYPES[precision]
    if distributed:
        opt = DistributedOptimizer(model, optim, "csrc", DTYPES[precision])
    else:
        opt, _ = build_optimizer(model.named_parameters(), optim, "cpu", "csrc")
    g = torch.Generator().manual_seed(pstate.dp_rank)
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_length + 1), generator=g)
    train_step(model, [{"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}])
    clip_grad_norm(model, 1.0)
    opt.step()
    measured = measure_state_bytes(model, opt)
    formula = state_bytes_per_param(precision, distributed, pstate.dp_size)
    got = measured.per_param()
    return {"precision": precision, "distributed": distributed, "dp": pstate.dp_size,
            "params": measured.params, "buckets": len(model.grads.buckets),
            "measured": [round(x, 5) for x in got], "formula": list(formula),
            "measured_total": round(sum(got), 5), "formula_total": sum(formula),
            "rel_diff": round(sum(got) / sum(formula) - 1, 7)}


def world_job(rank: int, world: int, port: int, cfg: ModelConfig, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        pstate = ParallelState.build(1, 1, list(range(world)))
        rows = [measure(pstate, cfg, p, d) for p in PRECISIONS for d in (False, True)]
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
        pstate.destroy()
    finally:
        dist.destroy_process_group()


def run_world(world: int, cfg: ModelConfig) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.start_processes(world_job, args=(world, port, cfg, out), nprocs=world, start_method="fork")
        return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "dist_optim.json"))
    args = parser.parse_args()
    meta = run_meta()
    rows = [row for world in (1, 2, 4) for row in run_world(world, BENCH_CFG)]
    for r in rows:
        sys.stdout.write(f"{r['precision']:5s} distributed={r['distributed']!s:5s} dp={r['dp']}  measured "
                         f"{r['measured_total']:.4f} {r['measured']}  formula {r['formula_total']:.4f}  "
                         f"({r['rel_diff']:+.2e})\n")
    Path(args.out).write_text(json.dumps({"meta": meta, "model": dataclasses.asdict(BENCH_CFG), "rows": rows},
                                         indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
