"""Activation memory kept for backward, per transformer layer and micro-batch, measured against
Korthikanti et al. 2022 (table 2), and the time recomputation costs.

The count is exact and device-independent (bench.counters: a ``saved_tensors_hooks`` pack hook
records every tensor autograd saves during one layer's forward, each storage once, the parameters'
storages excluded). The model runs in bf16 (16-bit activations, as the paper counts them) on CPU, one
layer, no tensor parallelism. Each row is compared with the paper's coefficients and with the kernel
set's profile (trainer.memory_formulas.ACTIVATION_PROFILES, what the plan uses). The time is forward +
backward of the layer, median of the runs, next to no recomputation measured in the same run.

    python bench/recompute.py [--out bench/results/recompute.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.counters import saved_activation_bytes  # noqa: E402
from bench.meta import run_meta  # noqa: E402
from trainer.config.model import ModelConfig  # noqa: E402
from trainer.memory_formulas import activation_bytes_per_layer, activation_profile  # noqa: E402
from trainer.model import recompute as R  # noqa: E402
from trainer.model.gpt import build_gpt  # noqa: E402

SHAPES = [(512, 2, 256, 8), (1024, 1, 512, 8), (256, 4, 512, 16)]  # (s, b, h, a)
SETTINGS = ["none", "selective", "full"]


def step_seconds(layer: torch.nn.Module, x: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        layer(x).float().sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(kernels: str, backend: str, shape: tuple[int, int, int, int], repeats: int) -> list[dict]:
    s, b, h, a = shape
    cfg = ModelConfig(num_layers=1, hidden_size=h, num_attention_heads=a, seq_length=s, vocab_size=256,
                    attention_backend=backend)
    model = build_gpt(cfg, 1, kernels=kernels).to(torch.bfloat16).train()
    rows, base_time = [], None
    for granularity in SETTINGS:
        R.apply(model, R.Recompute(granularity))
        # One layer (full recomputation checkpoints the layer; the stage's final LayerNorm is not a layer).
        layer = model.encoder.layers[0]
        run = functools.partial(R.recomputed, layer) if granularity == "full" else layer
        x = torch.randn(s, b, h, dtype=torch.bfloat16, requires_grad=True)
        measured = saved_activation_bytes(model.parameters(), functools.partial(run, x))
        secs = step_seconds(run, x, repeats)
        base_time = base_time or secs
        formula = activation_bytes_per_layer(s, b, h, a, recompute=granularity)
        planned = activation_bytes_per_layer(s, b, h, a, recompute=granularity,
                                             profile=activation_profile("cpu", kernels, backend, "bf16"))
        rows.append({"kernels": kernels, "attention_backend": backend, "s": s, "b": b, "h": h, "a": a,
                     "recompute": granularity, "measured_bytes": measured, "formula_bytes": formula,
                     "ratio": round(measured / formula, 3), "plan_bytes": planned,
                     "ratio_to_plan": round(measured / planned, 3), "step_s": secs,
                     "time_vs_none": round(secs / base_time, 3)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/recompute.json"))
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.manual_seed(0)
    rows = [r for kernels in ("csrc", "eager") for backend in ("softmax", "sdpa") for shape in SHAPES
            for r in measure(kernels, backend, shape, args.repeats)]
    for r in rows:
        print(f"{r['kernels']:5} {r['attention_backend']:7} s={r['s']:4} b={r['b']} h={r['h']:3} "
              f"a={r['a']:2} {r['recompute']:9} measured/paper {r['ratio']:5.2f}  "
              f"measured/plan {r['ratio_to_plan']:5.2f}  "
              f"time vs none {r['time_vs_none']:4.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": run_meta(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
