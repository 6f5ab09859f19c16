"""1F1B pipeline step time on CPU (gloo) against the single-stage compute time and the bubble formula.

With p stages and m micro-batches, 1F1B's step takes (1 + (p−1)/m) × t_stage, where t_stage is the
compute time of one stage's share of the step without any pipelining (performance.md, "Pipeline bubble").
Baseline, measured in the same run: the whole model's train_step over the same m micro-batches in one
process (T1); t_stage = T1 / p. Each pipeline stage is one process with one thread, as is the baseline,
which rank 0 times right after the pipelined steps (the other ranks wait), so that both see the same
machine load. Times are the best of ``--iters`` steps. Printed per (p, m): T1, t_stage, the measured
pipeline step, and measured / t_stage next to 1 + (p−1)/m. Results go to bench/results/pipeline.json.

    python bench/pipeline.py                          # p = 2, 4; m = p, 2p, 4p
    python bench/pipeline.py --stages 2 --microbatches 4 8 --iters 3

On a machine with fewer cores than stages the stages time-share the CPU and the ratio grows accordingly
(reported as ``cores``); other load on the machine inflates every figure (``loadavg`` is recorded).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.model import GPTConfig  # noqa: E402
from trainer.parallel import ParallelConfig, ParallelState, build_model, train_step  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "pipeline.json"


def batches(cfg: GPTConfig, m: int, micro_batch: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, cfg.vocab_size, (m, micro_batch, cfg.seq_length + 1), generator=g)
    return [{"tokens": s[:, :-1], "labels": s[:, 1:]} for s in seq]


def time_steps(model, data, warmup: int, iters: int, pstate: ParallelState | None = None) -> float:
    """Best step time; in a world of several ranks, the slowest rank's time of each step."""
    times = []
    for i in range(warmup + iters):
        if pstate is not None:
            dist.barrier()
        start = time.perf_counter()
        train_step(model, data)
        elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        if pstate is not None:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(elapsed.item())
    return min(times)


def _stage_worker(rank: int, p: int, port: int, args: argparse.Namespace, cfg: GPTConfig, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=p)
    pstate = ParallelState.build(1, p)
    model = build_model(cfg, ParallelConfig(pp_size=p, schedule="1f1b"), pstate, seed=0)
    single = build_model(cfg, ParallelConfig(), ParallelState.single(), seed=0) if rank == 0 else None
    result = {}
    for m in microbatch_counts(args, p):
        data = batches(cfg, m, args.micro_batch)
        piped = time_steps(model, data, args.warmup, args.iters, pstate)
        if rank == 0:  # the baseline under the same load; the other stages wait at the barrier
            result[m] = (piped, time_steps(single, data, args.warmup, args.iters))
        dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def microbatch_counts(args: argparse.Namespace, p: int) -> list[int]:
    return args.microbatches or [p, 2 * p, 4 * p]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace) -> dict:
    cfg = GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                    seq_length=args.seq, vocab_size=args.vocab, hidden_dropout=0.0, attention_dropout=0.0)
    rows = []
    for p in args.stages:
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            mp.start_processes(_stage_worker, args=(p, free_port(), args, cfg, tmp.name), nprocs=p,
                               start_method="fork")
            times = {int(k): v for k, v in json.loads(Path(tmp.name).read_text()).items()}
        for m, (piped, t1) in times.items():
            t_stage = t1 / p
            rows.append({"stages": p, "microbatches": m, "single_process_s": t1, "stage_compute_s": t_stage,
                         "pipeline_s": piped, "measured_ratio": piped / t_stage,
                         "predicted_ratio": 1 + (p - 1) / m})
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": platform.machine(),
            "cores": os.cpu_count(), "loadavg": os.getloadavg(), "torch": torch.__version__,
            "model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "seq": args.seq,
                      "vocab": args.vocab, "micro_batch": args.micro_batch}, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--microbatches", type=int, nargs="*", default=None, help="default: p, 2p, 4p")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=4)
    args = ap.parse_args()
    result = run(args)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"model {result['model']}; {result['cores']} cores; load avg {result['loadavg'][0]:.1f}")
    print(f"{'p':>2} {'m':>3} {'T1 (1 proc)':>12} {'T1/p':>8} {'pipeline':>9} {'measured/(T1/p)':>16} "
          f"{'1+(p-1)/m':>10} {'meas/pred':>9}")
    for r in result["rows"]:
        print(f"{r['stages']:>2} {r['microbatches']:>3} {r['single_process_s']:>11.3f}s "
              f"{r['stage_compute_s']:>7.3f}s {r['pipeline_s']:>8.3f}s {r['measured_ratio']:>16.2f} "
              f"{r['predicted_ratio']:>10.2f} {r['measured_ratio'] / r['predicted_ratio']:>9.2f}")
    print(f"-> {RESULTS}")


if __name__ == "__main__":
    main()
