"""What each change of issue 39 moves, one at a time: A/B rows of the real training step (bench/gpt_step.py)
of one model on one device, each against the baseline row measured in the same process.

    python bench/ab_step.py --device cuda --model codeparrot_small --micro-batches 16,32,64
    python bench/ab_step.py --device cuda --model gpt_1p3b --micro-batches 8,16 --rows baseline,master_weights
    python bench/ab_step.py --device cpu --model gpt_tiny --micro-batches 1,2 --steps 2  # rehearsal

The best micro-batch is the candidate with the most tokens/s for the baseline (sizes that run out of
memory are skipped); every row then runs at it. Rows (ROWS; --rows picks some): the baseline (bf16
autocast, csrc kernels, SDPA auto, the model file's attention dropout, the loop's step without host
syncs), then one change each: the master_weights recipe; attention dropout 0 (auto then picks cuDNN);
the same with flash forced (cuDNN vs flash); a host sync after every step (what the loop did before);
kernels=compile_layer (its first steps compile, untimed); and all the changes together. Each row prints
step ms, tokens/s, model TFLOP/s (Megatron's formula), MFU against the device's dense bf16 peak, peak
memory, the loss after its steps, and its throughput against the baseline. --budget-s skips the rows left
when the wall time is past it (the script's share of a short GPU call). --out writes ab_<model>_<device>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpt_step import StepSpec, build, sync  # noqa: E402
from bench.meta import run_meta  # noqa: E402

ROWS: dict[str, tuple[dict, bool]] = {  # name: (StepSpec changes, host sync after every step)
    "baseline": ({}, False),
    "master_weights": ({"recipe": "master_weights"}, False),
    "attn_dropout_0": ({"attention_dropout": 0.0}, False),
    "attn_dropout_0_flash": ({"attention_dropout": 0.0, "sdpa_backend": "flash"}, False),
    "sync_every_step": ({}, True),
    "compile_layer": ({"kernels": "compile_layer"}, False),
    "all_changes": ({"recipe": "master_weights", "kernels": "compile_layer", "attention_dropout": 0.0},
                    False),
}


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def measure(spec: StepSpec, device: torch.device, steps: int, warmup: int, sync_each: bool) -> dict:
    """Build ``spec``, run ``warmup`` steps, time ``steps`` (one sync at the end, or one per step)."""
    from trainer.run.metrics import detect_peak_tflops

    _free(device)
    stepper = build(spec, device)
    for _ in range(warmup):
        stepper.step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = stepper.step()
        if sync_each:
            float(loss)  # what the loop did every iteration before issue 39 (three reads, one wait)
    sync(device)
    step_s = (time.perf_counter() - t0) / steps
    tflops = stepper.flops_per_step() / step_s / 1e12
    peak = detect_peak_tflops(device, None)
    out = {"micro_batch": spec.micro_batch, "step_ms": 1e3 * step_s,
           "tokens_s": spec.micro_batch * stepper.seq / step_s, "tflops": tflops,
           "mfu": tflops / peak if peak else None, "loss": float(loss),
           "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}
    del stepper
    _free(device)
    return out


def _oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError)


def best_micro_batch(spec: StepSpec, device: torch.device, candidates: list[int], steps: int,
                     warmup: int) -> tuple[int | None, list[str]]:
    best, lines = None, []
    for mb in candidates:
        try:
            r = measure(dataclasses.replace(spec, micro_batch=mb), device, max(2, steps // 2), warmup, False)
        except Exception as e:
            if not _oom(e):
                raise
            _free(device)
            lines.append(f"  micro-batch {mb:>4}: out of memory")
            continue
        mem = f"  peak {r['peak_mem_gib']:.1f} GiB" if r["peak_mem_gib"] is not None else ""
        lines.append(f"  micro-batch {mb:>4}: {r['tokens_s']:>10.0f} tokens/s{mem}")
        if best is None or r["tokens_s"] > best[1]:
            best = (mb, r["tokens_s"])
    return (best[0] if best else None), lines


def row_line(name: str, r: dict, base: dict | None) -> str:
    mfu = f"{100 * r['mfu']:>6.1f}%" if r["mfu"] else f"{'-':>7}"
    mem = f"{r['peak_mem_gib']:>7.1f}" if r["peak_mem_gib"] is not None else f"{'-':>7}"
    ratio = f"{r['tokens_s'] / base['tokens_s']:>7.3f}x" if base else f"{'':>8}"
    return (f"{name:<22}{r['micro_batch']:>5}{r['step_ms']:>9.1f}{r['tokens_s']:>11.0f}{r['tflops']:>8.1f}"
            f"{mfu}{mem}{r['loss']:>8.3f}{ratio}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", default="codeparrot_small", help="hydra_conf/model/<name>.yaml")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--micro-batches", default="16,32,64", help="candidates for the best micro-batch; one "
                    "candidate is taken as it is (no search)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"some of {', '.join(ROWS)}")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=300.0, help="skip the rows left past this wall time")
    ap.add_argument("--out", default=None, help="folder for ab_<model>_<device>.json")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.stderr.write("ab_step.py: no CUDA device (use --device cpu to rehearse)\n")
        return 1
    start, device = time.perf_counter(), torch.device(a.device)
    rows = [r for r in a.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}: choose from {', '.join(ROWS)}")
    base_spec = StepSpec(a.model, a.vocab)
    candidates = [int(x) for x in a.micro_batches.split(",")]
    if len(candidates) == 1:
        mb, lines = candidates[0], [f"  micro-batch {candidates[0]} (given)"]
    else:
        mb, lines = best_micro_batch(base_spec, device, candidates, a.steps, a.warmup)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (rehearsal: no MFU)"
    print(f"{name}  torch {torch.__version__}  {a.model}  micro-batch (the baseline's best tokens/s):")
    print("\n".join(lines))
    if mb is None:
        print("no micro-batch fits")
        return 1
    print(f"{'row':<22}{'mb':>5}{'step ms':>9}{'tokens/s':>11}{'TFLOP/s':>8}{'MFU':>7}{'GiB':>7}{'loss':>8}"
          f"{'vs base':>8}")
    results: dict[str, dict] = {}
    for row in rows:
        if time.perf_counter() - start > a.budget_s:
            print(f"{row:<22} skipped: past the --budget-s of {a.budget_s:.0f} s", flush=True)
            continue
        changes, sync_each = ROWS[row]
        spec = dataclasses.replace(base_spec, micro_batch=mb, **changes)
        try:
            results[row] = {"spec": dataclasses.asdict(spec), "sync_every_step": sync_each,
                            **measure(spec, device, a.steps, a.warmup, sync_each)}
        except Exception as e:  # a row that fails (out of memory, no kernel) must not cost the others
            print(f"{row:<22} failed: {type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}",
                  flush=True)
            _free(device)
            continue
        print(row_line(row, results[row], results.get("baseline") if row != "baseline" else None), flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        path = os.path.join(a.out, f"ab_{a.model}_{a.device}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump({**run_meta(), "device": name, "model": a.model, "rows": results,
                       "what": "bench step (trainer.run.loop.step)"}, f, indent=1)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
