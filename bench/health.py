"""What heartbeats, the watchdog and the preflight cost, measured in this one run.

1. Step time with the health monitor watching (``Monitor.tick`` called by ``trainer.run.loop``: ticks
   from the batch iterator and the step, the heartbeat thread writing every 0.1 s, 100x more often than the
   default) versus the same steps with no Monitor at all (none constructed, no thread alive: the run
   records the threads alive during those steps), on the smallest model Slipway trains (the worst case
   for a per-step overhead). Steps alternate between the two in blocks so both see the same machine
   load; medians by wall clock and by process CPU time.
2. One ``tick`` and one heartbeat write, in isolation.
3. The preflight on gloo (CPU): 2 ranks on one node, and 4 ranks on 3 (named) nodes, against the
   ``init_process_group`` of the same processes.

    python bench/health.py            # writes bench/results/health.json
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.meta import load, run_meta  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "health.json"


def _loop(run_dir: str):
    from trainer.config import RunConfig
    from trainer.parallel import ParallelState
    from trainer.run.entry import build_components
    from trainer.run.loop import Cadence, Loop, Throughput

    cfg = RunConfig.from_dict({
        "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
                  "vocab_size": 1000},
        "train": {"micro_batch_size": 2, "global_batch_size": 2, "iters": 10**6, "device": "cpu"},
        "optim": {"lr": 1e-4}, "kernels": "auto", "run_dir": run_dir})
    c = build_components(cfg, ParallelState.single())
    return Loop(model=c.model, optimizer=c.parts.optimizer, scheduler=c.parts.scheduler,
                scaler=c.parts.scaler, precision="fp32", clip_grad=1.0, global_batch_size=2,
                num_microbatches=1, train_iters=10**6, train_data=None, valid_data=None, save=lambda s: None,
                wandb=None, cadence=Cadence(10, None, 0, None), throughput=Throughput(0.0, 128, 1, None))


def step_overhead(blocks: int = 12, per_block: int = 10) -> dict:
    """Blocks of steps alternate between two identical loops: one with no Monitor at all (none constructed,
    no thread), one watched by a Monitor started for that block and stopped after it (``with``: its
    thread joined), so that the baseline pays nothing of the monitor."""
    import threading

    from trainer.health import HealthConfig, Monitor
    from trainer.run.loop import next_batches, step

    run_dir = tempfile.mkdtemp(prefix="slipway-bench-health-")
    g = torch.Generator().manual_seed(0)

    def batches():
        while True:
            t = torch.randint(0, 1000, (2, 65), generator=g)
            yield {"tokens": t[:, :-1], "labels": t[:, 1:]}

    loops = {"plain": _loop(run_dir), "watched": _loop(run_dir)}
    data = {name: batches() for name in loops}
    times: dict[str, list[tuple[float, float]]] = {"plain": [], "watched": []}
    threads_in_plain: set[str] = set()

    def block(name: str) -> None:
        loop = loops[name]
        for it in range(per_block):
            w0, c0 = time.perf_counter(), time.process_time()
            step(loop, next_batches(loop, loop.train_data, "train"))  # what train() does per step
            if loop.monitor is not None:
                loop.monitor.tick(it)
            times[name].append((time.perf_counter() - w0, time.process_time() - c0))

    for i in range(blocks * 2):
        name = ("plain", "watched")[i % 2]
        loop = loops[name]
        loop.train_data, loop.monitor = data[name], None
        if name == "plain":
            threads_in_plain.update(t.name for t in threading.enumerate())
            block(name)
            continue
        with Monitor(HealthConfig(heartbeat_interval_s=0.1, hang_timeout_s=60), run_dir) as m:
            m.begin()
            loop.monitor = m
            block(name)
    out: dict = {"threads_alive_in_plain_blocks": sorted(threads_in_plain)}
    for name, rows in times.items():
        out[name] = {"wall_ms": statistics.median(r[0] for r in rows) * 1e3,
                     "cpu_ms": statistics.median(r[1] for r in rows) * 1e3}
    out["ratio_wall"] = out["watched"]["wall_ms"] / out["plain"]["wall_ms"]
    out["ratio_cpu"] = out["watched"]["cpu_ms"] / out["plain"]["cpu_ms"]
    return out


def micro() -> dict:
    from trainer.health import HealthConfig, Monitor

    m = Monitor(HealthConfig(), tempfile.mkdtemp(prefix="slipway-bench-health-"))
    n = 200_000
    t0 = time.perf_counter()
    for i in range(n):
        m.tick(i)
    tick_ns = (time.perf_counter() - t0) / n * 1e9
    os.makedirs(os.path.join(m.run_dir, "heartbeats"))
    t0 = time.perf_counter()
    for _ in range(200):
        m.write()
    return {"tick_ns": tick_ns, "heartbeat_write_us": (time.perf_counter() - t0) / 200 * 1e6}


def _preflight_rank(rank: int, world: int, nodes: list[str], store: str, run_dir: str) -> None:
    import torch.distributed as dist

    from trainer.health import HealthConfig
    from trainer.health.preflight import run_preflight

    os.environ["SLIPWAY_NODE_NAME"] = nodes[rank]
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    init_s = time.perf_counter() - t0
    report = run_preflight(HealthConfig(preflight_slow_factor=1e3), run_dir, torch.device("cpu"))
    if rank == 0:
        with open(os.path.join(run_dir, "bench.json"), "w") as f:
            json.dump({"init_s": init_s, "preflight_s": report["seconds"]}, f)
    dist.destroy_process_group()


def preflight(nodes: list[str]) -> dict:
    import torch.multiprocessing as mp

    run_dir = tempfile.mkdtemp(prefix="slipway-bench-preflight-")
    mp.start_processes(_preflight_rank, args=(len(nodes), nodes, os.path.join(run_dir, "store"), run_dir),
                       nprocs=len(nodes), start_method="spawn")
    got = json.loads(Path(run_dir, "bench.json").read_text())
    report = json.loads(Path(run_dir, "preflight.json").read_text())
    return {"ranks": len(nodes), "nodes": len(set(nodes)), **got,
            "ratio_to_init": got["preflight_s"] / got["init_s"],
            "allreduce_ms": report["allreduce"]["seconds"] * 1e3, "links_gbps": report["links_gbps"]}


def main() -> int:
    torch.set_num_threads(1)
    result = {
        **run_meta(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "step_overhead": step_overhead(),
        "micro": micro(),
        "preflight": [preflight(["n1", "n1"]), preflight(["nA", "nA", "nB", "nC"])],
        "load_after": load(),
    }
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    s, p, u = result["step_overhead"], result["preflight"], result["micro"]
    sys.stdout.write(
        f"step with health monitor / without: {s['ratio_wall']:.3f} wall, {s['ratio_cpu']:.3f} CPU "
        f"(baseline {s['plain']['wall_ms']:.1f} ms wall per step, no Monitor; threads alive then: "
        f"{s['threads_alive_in_plain_blocks']})\n"
        f"commit {result['commit']}, load {result['load_before']} -> {result['load_after']}\n"
        f"tick {u['tick_ns']:.0f} ns, heartbeat write {u['heartbeat_write_us']:.0f} us\n"
        + "".join(f"preflight {q['ranks']} ranks / {q['nodes']} node(s): {q['preflight_s']:.2f} s, "
                  f"{q['preflight_s'] / 2.0:.2f}x the 2 s budget (group init: {q['init_s']:.2f} s)\n"
                  for q in p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
