"""1F1B pipeline step time on CPU (gloo) against the single-stage compute time and the bubble formula.

With p stages and m micro-batches, 1F1B's step takes (1 + (p−1)/m) × t_stage, where t_stage is the
compute time of one stage's share of the step without any pipelining (performance.md, "Pipeline bubble");
the interleaved schedule with v model chunks per stage (``--virtual``) takes (1 + (p−1)/(v·m)) × t_stage
(``trainer.time_formulas.bubble_fraction``).
Baseline, measured in the same run: the whole model's train_step over the same m micro-batches in one
process (T1); t_stage = T1 / p. Each pipeline stage is one process with one thread, as is the baseline,
which rank 0 times right after the pipelined steps (the other ranks wait), so that both see the same
machine load. Times are the best of ``--iters`` steps. Results go to bench/results/pipeline.json.

Two clocks, each with its own T1:
- wall: ``perf_counter``; the real step time. On a machine with fewer free cores than stages, or with
  other load, it measures the machine's contention as much as the schedule.
- cpu: each stage's CPU time (``thread_time``) carried with every activation/gradient message as a
  Lamport clock (a receiver's clock jumps to the sender's if it is ahead). The step's length on it is
  the schedule's critical path in compute time: the step with one dedicated core per stage and free
  communication. Immune to other load, it checks that the schedule has no stalls beyond 1F1B's bubble.

    python bench/pipeline.py                          # p = 2, 4; m = p, 2p, 4p; v = 1, 2
    python bench/pipeline.py --stages 2 --microbatches 4 8 --virtual 2 --iters 3
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

from bench.meta import commit  # noqa: E402
from trainer.config.model import ModelConfig  # noqa: E402
from trainer.parallel import ParallelConfig, ParallelState, build_model, train_step  # noqa: E402
from trainer.parallel.interleaved import ACTIVATION_TAG, GRADIENT_TAG, RingP2P  # noqa: E402
from trainer.parallel.pipeline import P2P  # noqa: E402
from trainer.time_formulas import bubble_fraction  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "pipeline.json"


def batches(cfg: ModelConfig, m: int, micro_batch: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, cfg.vocab_size, (m, micro_batch, cfg.seq_length + 1), generator=g)
    return [{"tokens": s[:, :-1], "labels": s[:, 1:]} for s in seq]


class ClockedP2P(P2P):
    """P2P that also sends this stage's CPU-time clock to the peers it sends to (see module doc)."""

    offset = 0.0  # one pipeline stage per process: the clock is thread_time() + offset

    # Static, on ClockedP2P itself: a classmethod's ``cls.offset += …`` on a subclass (ClockedRingP2P)
    # would start a second clock that time_steps never reads.
    @staticmethod
    def now() -> float:
        return time.thread_time() + ClockedP2P.offset

    @staticmethod
    def advance_to(t: float) -> None:
        ClockedP2P.offset += max(0.0, t - ClockedP2P.now())

    def peers(self) -> tuple[int, int]:
        return self.pstate.prev_rank if not self.pstate.is_first_stage else -1, \
            self.pstate.next_rank if not self.pstate.is_last_stage else -1

    def _exchange(self, to_next=None, to_prev=None, from_next=False, from_prev=False):
        sent_at = torch.tensor([self.now()], dtype=torch.float64)
        got = super()._exchange(to_next, to_prev, from_next, from_prev)
        (prev, nxt), group, works, clocks = self.peers(), self.pstate.pp_group.pg, [], []
        # Tags as the data they follow (RingP2P): with p=2 on the ring both directions share one link.
        for send, peer, tag in ((to_next is not None, nxt, CLOCK_TAG + ACTIVATION_TAG),
                                (to_prev is not None, prev, CLOCK_TAG + GRADIENT_TAG)):
            if send:
                works.append(dist.isend(sent_at.clone(), peer, group=group, tag=tag))
        for recv, peer, tag in ((from_prev, prev, CLOCK_TAG + ACTIVATION_TAG),
                                (from_next, nxt, CLOCK_TAG + GRADIENT_TAG)):
            if recv:
                clocks.append(torch.zeros(1, dtype=torch.float64))
                works.append(dist.irecv(clocks[-1], peer, group=group, tag=tag))
        for work in works:
            work.wait()
        self.advance_to(max((c.item() for c in clocks), default=0.0))
        return got


CLOCK_TAG = 10  # clock messages travel beside the data, on tags of their own


class ClockedRingP2P(ClockedP2P, RingP2P):
    """The interleaved schedule's ring exchange, clocked the same way."""

    def peers(self) -> tuple[int, int]:
        return self.prev_rank, self.next_rank


def time_steps(model, data, warmup: int, iters: int,
               pstate: ParallelState | None = None) -> tuple[float, float, float]:
    """Best (wall, cpu-clock, busy) step times; with several ranks, the slowest rank's time of each step.
    busy: the CPU time a rank itself spent in the step (no clock jumps), of the busiest rank."""
    times = []
    for i in range(warmup + iters):
        if pstate is not None:  # start together, on both clocks
            dist.barrier()
            start_clock = torch.tensor([ClockedP2P.now()], dtype=torch.float64)
            dist.all_reduce(start_clock, op=dist.ReduceOp.MAX)
            ClockedP2P.advance_to(start_clock.item())
        c0, w0, b0 = ClockedP2P.now(), time.perf_counter(), time.thread_time()
        train_step(model, data)
        elapsed = torch.tensor([time.perf_counter() - w0, ClockedP2P.now() - c0, time.thread_time() - b0],
                               dtype=torch.float64)
        if pstate is not None:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(elapsed.tolist())
    return min(t[0] for t in times), min(t[1] for t in times), min(t[2] for t in times)


def _stage_worker(rank: int, p: int, port: int, args: argparse.Namespace, cfg: ModelConfig, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=p)
    pstate = ParallelState.build(1, p)
    single = build_model(cfg, ParallelConfig(), ParallelState.single(), seed=0) if rank == 0 else None
    result = {}
    for v in args.virtual:
        pcfg = ParallelConfig(pp_size=p, virtual_pp_size=v, schedule="1f1b")
        model = build_model(cfg, pcfg, pstate, seed=0)
        model.p2p_class = ClockedRingP2P if v > 1 else ClockedP2P
        for m in microbatch_counts(args, p):
            data = batches(cfg, m, args.micro_batch)
            piped = time_steps(model, data, args.warmup, args.iters, pstate)
            if rank == 0:  # the baseline under the same load; the other stages wait at the barrier
                result[f"{v},{m}"] = (piped, time_steps(single, data, args.warmup, args.iters))
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
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                    seq_length=args.seq, vocab_size=args.vocab, hidden_dropout=0.0, attention_dropout=0.0)
    rows, load_before = [], os.getloadavg()
    for p in args.stages:
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            mp.start_processes(_stage_worker, args=(p, free_port(), args, cfg, tmp.name), nprocs=p,
                               start_method="fork")
            saved = json.loads(Path(tmp.name).read_text())
        for key, (piped, t1) in saved.items():
            v, m = map(int, key.split(","))
            row = {"stages": p, "virtual": v, "microbatches": m,
                   "predicted_ratio": 1 + bubble_fraction(p, m, v)}
            for i, clock in enumerate(("wall", "cpu")):
                row[clock] = {"single_process_s": t1[i], "stage_compute_s": t1[i] / p, "pipeline_s": piped[i],
                              "measured_ratio": piped[i] / (t1[i] / p)}
            # The critical path against the busiest stage's own compute in the same step: the schedule's
            # bubble alone, without T1/p's assumptions (equal stages, the same speed per layer).
            row["cpu"].update({"busiest_stage_s": piped[2], "busy_ratio": piped[1] / piped[2]})
            rows.append(row)
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": commit(),
            "machine": platform.machine(), "cores": os.cpu_count(), "loadavg_before": load_before,
            "loadavg": os.getloadavg(), "torch": torch.__version__,
            "model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "seq": args.seq,
                      "vocab": args.vocab, "micro_batch": args.micro_batch}, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--microbatches", type=int, nargs="*", default=None, help="default: p, 2p, 4p")
    ap.add_argument("--virtual", type=int, nargs="+", default=[1, 2],
                    help="model chunks per stage (interleaved when > 1); p·v must divide --layers")
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
    print(f"model {result['model']}; {result['cores']} cores; load avg {result['loadavg_before'][0]:.1f} -> "
          f"{result['loadavg'][0]:.1f}; commit {result['commit']}")
    print(f"{'clock':>5} {'p':>2} {'v':>2} {'m':>3} {'T1 (1 proc)':>12} {'T1/p':>8} {'pipeline':>9} "
          f"{'measured/(T1/p)':>16} {'1+(p-1)/vm':>10} {'meas/pred':>9} {'cp/busiest':>10}")
    for clock in ("wall", "cpu"):
        for r in result["rows"]:
            c = r[clock]
            print(f"{clock:>5} {r['stages']:>2} {r['virtual']:>2} {r['microbatches']:>3} "
                  f"{c['single_process_s']:>11.3f}s "
                  f"{c['stage_compute_s']:>7.3f}s {c['pipeline_s']:>8.3f}s {c['measured_ratio']:>16.2f} "
                  f"{r['predicted_ratio']:>10.2f} {c['measured_ratio'] / r['predicted_ratio']:>9.2f} "
                  f"{c.get('busy_ratio', float('nan')):>10.2f}")
    print(f"-> {RESULTS}")


if __name__ == "__main__":
    main()
