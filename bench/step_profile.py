"""Where a training step's time goes: N steps of the real step (bench/gpt_step.py: build_components and
trainer.run.loop.step) under torch.profiler, by class, and how long the device sat idle.

    python bench/step_profile.py --device cuda --micro-batch 64                      # CodeParrot-small, bf16
    python bench/step_profile.py --device cuda --recipe master_weights --kernels compile_layer --top 5
    python bench/step_profile.py --device cpu --model gpt_tiny --micro-batch 2 --steps 2   # rehearsal

CUDA: every kernel, memcpy and memset the profiled steps put on the device, summed by class (CLASSES, in
order, first match wins: optimizer (AdamW, the gradient norm and clipping), attention, GEMM, Slipway's own
ops, communication, reductions, element-wise/copy/fill, other), in ms per step and as a share of the
window; the window runs from the first profiled step's start on the host to the last device activity,
and the device idle share is the part of it no device activity covers (host synchronisation, launch
gaps, the data). CPU (the rehearsal): the same classes over the ops' self CPU time, and the share of the
wall time no op accounts for (Python, the loop, waiting). Prints a table (and the top kernels of each
class with --top); ``--out DIR`` also writes profile_<device>_<tag>.json (and a chrome trace with --trace).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpt_step import StepSpec, build, sync  # noqa: E402
from bench.meta import run_meta  # noqa: E402

MARK = "slipway_step"
CLASSES = (
    ("optimizer", r"adam|multi_tensor|_foreach_|lerp"),
    ("attention", r"flash|fmha|attention|sdpa|_sdp_|cudnn.*(attn|mha|sdp)|mha_|attn"),
    ("GEMM", r"gemm|cutlass|cublas|nvjet|xmma|wgmma|sm90_|sm80_|s16816|aten::(mm|addmm|bmm|baddbmm|matmul|"
             r"linear|_addmm_activation)$|triton_tem"),
    ("Slipway ops", r"slipway"),
    # before reductions: an NCCL AllReduce kernel's name says "reduce" too
    ("communication", r"nccl|all_?reduce|all_?gather|reduce_?scatter|gloo|broadcast"),
    ("reductions", r"reduce|norm|sum|mean|softmax|triton_(red|per)_|logsumexp|aten::(max|min|amax)$"),
    ("element-wise/copy/fill", r"elementwise|vectorized|copy|fill|cat|index|memset|memcpy|triton_poi|"
                               r"unrolled|aten::(add|mul|sub|div|where|dropout|gelu|embedding|to|_to_copy|clone|zero_|"
                               r"pow|sqrt|rsqrt|neg|exp|log|masked_fill|transpose|view|permute|reshape|"
                               r"contiguous|t|expand|split|squeeze|unsqueeze|flatten|empty|zeros|ones|"
                               r"randint|native_dropout|bernoulli_|detach|slice|select|stack)_?$"),
    ("other", r""),
)
_COMPILED = [(name, re.compile(pattern, re.IGNORECASE)) for name, pattern in CLASSES]


def classify(name: str) -> str:
    return next(cls for cls, pattern in _COMPILED if pattern.search(name))


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -float("inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _is_device(e) -> bool:
    return e.device_type != torch.autograd.DeviceType.CPU


def _kineto_device_events(prof) -> list[tuple[str, float, float]]:
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if results is None:
        return []
    return [(e.name(), e.start_ns() / 1e3, (e.start_ns() + e.duration_ns()) / 1e3) for e in results.events()
            if str(e.device_type()).endswith(("CUDA", "PrivateUse1"))]


def summarize(events, device: torch.device, steps: int, wall_s: float, prof=None) -> dict:
    """Per class: ms per step, share of the window, count per step; the idle share of the window."""
    marks = [e for e in events if e.name == MARK and not _is_device(e)]
    start = min(e.time_range.start for e in marks) if marks else None
    by: dict[str, dict] = {}
    top: dict[str, dict[str, float]] = {}
    if device.type == "cuda":
        work = [(e.name, e.time_range.start, e.time_range.end) for e in events
                if _is_device(e) and e.name != MARK and not e.name.startswith("gpu_user")]
        if not work:  # a torch whose event list leaves the kernels out: kineto's own records
            work = _kineto_device_events(prof)
        items = [(name, b - a) for name, a, b in work]
        first = start if start is not None else min(a for _, a, _ in work)
        end = max((b for _, _, b in work), default=first)
        window_us = max(end - first, 1.0)
        busy_us = _union([(max(a, first), b) for _, a, b in work])
    else:  # self CPU time of every op (the averages' self times add up to the time spent in ops)
        items = [(e.key, e.self_cpu_time_total) for e in events.key_averages() if e.key != MARK
                 and not e.key.startswith("ProfilerStep")]
        window_us, busy_us = wall_s * 1e6, sum(us for _, us in items)
    for name, us in items:
        cls = classify(name)
        row = by.setdefault(cls, {"ms_per_step": 0.0, "count_per_step": 0.0})
        row["ms_per_step"] += us / 1e3 / steps
        row["count_per_step"] += 1 / steps if device.type == "cuda" else 0
        top.setdefault(cls, {}).setdefault(name, 0.0)
        top[cls][name] += us / 1e3 / steps
    for row in by.values():
        row["share"] = row["ms_per_step"] * steps * 1e3 / window_us
    return {"classes": {cls: by[cls] for cls, _ in CLASSES if cls in by},
            "window_ms_per_step": window_us / 1e3 / steps, "busy_ms_per_step": busy_us / 1e3 / steps,
            "idle_share": max(0.0, 1 - busy_us / window_us),
            "top": {cls: dict(sorted(names.items(), key=lambda kv: -kv[1])[:10])
                    for cls, names in top.items()}}


def report(spec: StepSpec, summary: dict, device: torch.device, rates: dict, top: int) -> str:
    what = "device time (kernels)" if device.type == "cuda" else "CPU op self time"
    idle = "device idle" if device.type == "cuda" else "not in any op (Python, loop, waits)"
    lines = [f"profile: {spec.label()} on {rates['device']}: step {rates['step_ms']:.1f} ms, "
             f"{rates['tokens_s']:.0f} tokens/s, {rates['tflops']:.1f} TFLOP/s"
             + (f", MFU {100 * rates['mfu']:.1f}%" if rates.get("mfu") else ""),
             f"{'class (' + what + ')':<44}{'ms/step':>10}{'share':>8}{'kernels/step':>14}"]
    for cls, row in summary["classes"].items():
        count = f"{row['count_per_step']:>14.0f}" if device.type == "cuda" else f"{'-':>14}"
        lines.append(f"  {cls:<42}{row['ms_per_step']:>10.2f}{100 * row['share']:>7.1f}%{count}")
        for name, ms in list(summary["top"][cls].items())[:top]:
            lines.append(f"      {ms:>8.2f} ms  {name[:100]}")
    lines.append(f"  {idle:<42}{summary['window_ms_per_step'] - summary['busy_ms_per_step']:>10.2f}"
                 f"{100 * summary['idle_share']:>7.1f}%")
    lines.append(f"  {'window (first step start → last activity)':<42}{summary['window_ms_per_step']:>10.2f}")
    return "\n".join(lines)


def profile(spec: StepSpec, device: torch.device, steps: int, warmup: int, trace: str | None = None):
    """(summary, rates) of ``steps`` profiled steps after ``warmup`` unprofiled ones."""
    from torch.profiler import ProfilerActivity, record_function

    from trainer.run.metrics import detect_peak_tflops

    stepper = build(spec, device)
    for _ in range(warmup):
        stepper.step()
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            with record_function(MARK):
                loss = stepper.step()
        sync(device)
        wall = time.perf_counter() - t0
    if trace:
        prof.export_chrome_trace(trace)
    summary = summarize(prof.events(), device, steps, wall, prof)
    step_s = wall / steps
    peak = detect_peak_tflops(device, None)
    tflops = stepper.flops_per_step() / step_s / 1e12
    rates = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
             "step_ms": 1e3 * step_s, "tokens_s": spec.micro_batch * stepper.seq / step_s, "tflops": tflops,
             "mfu": tflops / peak if peak else None, "loss": float(loss),
             "peak_mem_gib": (torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda"
                              else None)}
    return summary, rates


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", default="codeparrot_small", help="hydra_conf/model/<name>.yaml")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--recipe", default="autocast", choices=["autocast", "master_weights"])
    ap.add_argument("--kernels", default="csrc")
    ap.add_argument("--sdpa-backend", default="auto")
    ap.add_argument("--attention-dropout", type=float, default=None, help="default: the model file's")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=3, help="kernels listed per class")
    ap.add_argument("--tag", default="", help="names the JSON file")
    ap.add_argument("--out", default=None, help="folder for profile_<device>_<tag>.json")
    ap.add_argument("--trace", action="store_true", help="also write a chrome trace beside the JSON")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.stderr.write("step_profile.py: no CUDA device (use --device cpu to rehearse)\n")
        return 1
    device = torch.device(a.device)
    spec = StepSpec(a.model, a.vocab, a.micro_batch, a.precision, a.recipe, a.kernels, a.sdpa_backend,
                    a.attention_dropout)
    base = os.path.join(a.out, f"profile_{a.device}_{a.tag or a.model}") if a.out else None
    trace = f"{base}.trace.json" if base and a.trace else None
    summary, rates = profile(spec, device, a.steps, a.warmup, trace)
    print(report(spec, summary, device, rates, a.top), flush=True)
    if base:
        os.makedirs(a.out, exist_ok=True)
        with open(base + ".json", "w", encoding="utf-8") as f:
            json.dump({**run_meta(), "spec": spec.__dict__, "steps": a.steps, "rates": rates, **summary}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
