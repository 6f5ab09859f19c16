"""Each fused csrc op against the eager composition it replaces and against ``torch.compile`` of that
composition (``kernels=compile``, the third implementation), timed in the same process.

    python bench/fused_ops.py                 # CPU (and CUDA when present), prints a table
    python bench/fused_ops.py --device cuda --scale 1.0
    python bench/fused_ops.py --no-compile    # without the compile column (inductor's CPU compile is slow)

Ratios = eager time / fused time and eager time / compiled time (> 1: faster than eager), for forward and
forward+backward, best of --reps alternating runs after warm-up (the warm-up compiles). The compiled ops
are the trainer's own (``trainer.ops.resolve("compile")``); AdamW has none (the trainer keeps it eager).
Shapes are CodeParrot-small's (h=768, 12 heads, V=32768) with the token count scaled by --scale (CPU
default 0.5 of one 2×1024-token micro-batch). Results also go to bench/results/kernels_<device>.txt with
date, machine and versions.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.meta import commit, load  # noqa: E402
from trainer import extension as _ext  # noqa: E402
from trainer.ops import reference, resolve  # noqa: E402


@dataclass
class Case:
    name: str
    fused: Callable[[], torch.Tensor | None]
    eager: Callable[[], torch.Tensor | None]
    backward: bool = True
    compiled: Callable[[], torch.Tensor | None] | None = None


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _clock(device: str) -> Callable[[], float]:
    """CPU time of this thread on a single-threaded CPU run (the development boxes are shared: time spent
    descheduled is not the code's), else wall time (GPU work is measured after synchronising)."""
    return time.thread_time if device == "cpu" and torch.get_num_threads() == 1 else time.perf_counter


def timed(fns: list[Callable[[], object]], device: str, reps: int) -> list[float]:
    """Best-of-reps seconds of each fn, run in turn so drifting machine load hits them alike.

    The minimum, not the median: the least-disturbed run measures the code rather than the neighbours.
    """
    clock = _clock(device)
    for fn in fns + fns:
        fn()
    _sync(device)
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = clock()
            fn()
            _sync(device)
            best[i] = min(best[i], clock() - t0)
    return best


def _fwd_bwd(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        out = fn()
        out.backward(torch.ones_like(out))
    return run


# What each row's tensors are, per dtype row (printed with the table: a "bf16" row is not all bf16).
DTYPES = {
    "bias_gelu": "x {dt}, bias fp32 (a param under autocast)",
    "bias_dropout_add": "x {dt}, bias fp32, residual fp32 (the fp32 residual stream under autocast)",
    "scaled_causal_softmax": "scores {dt}",
    "layer_norm": "x, weight, bias {dt}; statistics fp32",
    "cross_entropy": "logits {dt}; loss fp32",
    "rms_norm": "x, weight {dt}; statistics fp32",
    "swiglu": "x {dt} [tokens, 2·2048] (gate | up)",
    "rotary": "q {dt} [b, 12 heads, s, 64]; cos, sin fp32 [s, 64]",
    "adamw_step": "25 tensors. fp32 row: params, grads, moments fp32. bf16 row: model params and grads "
                  "bf16, fp32 master weights and fp32 moments (the kernel updates the master and writes the "
                  "bf16 copy)",
}


def cases(device: str, dtype: torch.dtype, tokens: int, compile_ops: bool = True) -> list[Case]:
    """Every op's fused, eager and (with ``compile_ops``) compiled callables on the same tensors."""
    from trainer.ops import adamw, cross_entropy, fused

    comp = resolve("compile", device) if compile_ops else None
    h, heads, vocab = 768, 12, 32768
    seq = min(1024, tokens)
    kw = dict(device=device, dtype=dtype)
    x4 = torch.randn(tokens, 4 * h, **kw).requires_grad_()
    b4 = torch.randn(4 * h, device=device, requires_grad=True)  # fp32 bias, as under autocast
    x = torch.randn(tokens, h, **kw).requires_grad_()
    b = torch.randn(h, device=device, requires_grad=True)
    res = torch.randn(tokens, h, device=device, requires_grad=True)  # fp32 residual stream
    w = torch.randn(h, **kw).requires_grad_()
    lb = torch.randn(h, **kw).requires_grad_()
    xr = torch.randn(tokens, h, **kw).requires_grad_()
    scores = torch.randn(max(1, tokens // seq), heads, seq, seq, **kw).requires_grad_()
    logits = torch.randn(tokens, vocab, **kw).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), device=device)
    n_params = 4 * tokens * h
    ffn, head_dim = 2048, h // heads  # Llama's SwiGLU width for h = 768 (8h/3) and the head size
    xn = torch.randn(tokens, h, **kw).requires_grad_()
    wn = torch.randn(h, **kw).requires_grad_()
    xg = torch.randn(tokens, 2 * ffn, **kw).requires_grad_()
    q = torch.randn(max(1, tokens // seq), heads, seq, head_dim, **kw).requires_grad_()
    cos, sin = torch.randn(seq, head_dim, device=device), torch.randn(seq, head_dim, device=device)
    args = {"bias_gelu": (x4, b4), "bias_dropout_add": (x, b, res, 0.1, True),
            "scaled_causal_softmax": (scores, 0.125), "layer_norm": (xr, w, lb, 1e-5),
            "cross_entropy": (logits, target), "rms_norm": (xn, wn, 1e-5), "swiglu": (xg,),
            "rotary": (q, cos, sin)}
    fused_ops = {"cross_entropy": cross_entropy.cross_entropy,
                 **{op: getattr(fused, op) for op in args if op != "cross_entropy"}}
    out = [Case(op, functools.partial(fused_ops[op], *a), functools.partial(getattr(reference, op), *a),
                compiled=_compiled(comp, op, a)) for op, a in args.items()]
    return out + [_adamw_case(device, dtype, n_params, adamw)]


def _compiled(comp, op: str, args: tuple) -> Callable[[], torch.Tensor] | None:
    """The trainer's compiled ``op`` bound to ``args``, or None where it keeps the op uncompiled."""
    if comp is None or comp.names[op] != "compile":
        return None
    return functools.partial(getattr(comp, op), *args)


def _adamw_case(device: str, dtype: torch.dtype, n_params: int, adamw) -> Case:
    """fp32: the masters are the params. Otherwise ``dtype`` params and grads with fp32 masters and moments,
    as ``FusedAdamW`` keeps them for a low-precision model (Slipway's own bf16 training is autocast over
    fp32 params, so it runs the fp32 case)."""
    shapes = [(n_params // 8,), (n_params // 4,), (n_params // 2,), (768,), (768,)] + [(64,)] * 20
    low = dtype != torch.float32

    def state():
        masters = [torch.randn(s, device=device) for s in shapes]
        return adamw.AdamWTensors(masters, [torch.randn(s, device=device, dtype=dtype) for s in shapes],
                                  [torch.zeros(s, device=device) for s in shapes],
                                  [torch.zeros(s, device=device) for s in shapes],
                                  [m.to(dtype) for m in masters] if low else [])
    hp = adamw.AdamWHyper(lr=1e-4, weight_decay=0.1)
    mine, ref = state(), state()
    return Case("adamw_step", lambda: adamw.adamw_step(mine, hp, 3),
                lambda: reference.adamw_step(ref, hp, 3), backward=False)


NAN = float("nan")


def run(device: str, dtype: torch.dtype, tokens: int, reps: int, only: tuple[str, ...] = (),
        compile_ops: bool = True) -> list[tuple]:
    """(name, (fused, eager, compiled) forward seconds, the same for forward+backward) per case (those in
    ``only``); NaN where a case has no backward or no compiled op."""
    rows = []
    for c in (c for c in cases(device, dtype, tokens, compile_ops) if not only or c.name in only):
        fns = [c.fused, c.eager] + ([c.compiled] if c.compiled else [])
        fwd = timed(fns, device, reps) + [NAN] * (3 - len(fns))
        fb = (timed([_fwd_bwd(f) for f in fns], device, reps) + [NAN] * (3 - len(fns)) if c.backward
              else [NAN] * 3)
        rows.append((c.name, tuple(fwd), tuple(fb)))
    return rows


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or platform.machine())


def render(device: str, dtype: torch.dtype, tokens: int, rows) -> str:
    head = (f"# bench/fused_ops.py  {datetime.datetime.now().isoformat(timespec='seconds')}  "
            f"commit {commit()}  load {load()}\n"
            f"# device={device} ({_device_name(device)}) "
            f"threads={torch.get_num_threads()} torch={torch.__version__} dtype={dtype} tokens={tokens}\n"
            f"# e/f = eager / fused, e/c = eager / compiled (torch.compile of the eager composition, as "
            f"kernels=compile runs it); >1: faster than eager; ms, best of alternating runs "
            f"({'thread CPU time' if _clock(device) is time.thread_time else 'wall time'})\n")
    cols = "".join(f"{c:>11}" for c in ("fused", "eager", "compile")) + f"{'e/f':>7}{'e/c':>7}"
    lines = [f"{'':<26}{'forward':<47}{'forward + backward'}", f"{'op':<26}{cols}{cols}"]
    for name, fwd, fb in rows:
        lines.append(f"{name:<26}{_cells(fwd)}{_cells(fb)}")
    dt = str(dtype).removeprefix("torch.").replace("float32", "fp32").replace("bfloat16", "bf16")
    lines += [f"#   {name}: {DTYPES[name].format(dt=dt)}" for name, *_ in rows]
    return head + "\n".join(lines) + "\n"


def _cells(t: tuple[float, float, float]) -> str:
    """Three times in ms and the two ratios to eager; '-' for what was not measured."""
    def ms(x: float) -> str:
        return f"{x * 1e3:>11.3f}" if x == x else f"{'-':>11}"

    def ratio(a: float, b: float) -> str:
        return f"{a / b:>7.2f}" if a == a and b == b else f"{'-':>7}"

    fused, eager, comp = t
    return ms(fused) + ms(eager) + ms(comp) + ratio(eager, fused) + ratio(eager, comp)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--scale", type=float, default=None,
                    help="tokens = scale × 2048 (default cpu 0.5, cuda 8)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads (default 1: timed in thread CPU time, robust on a shared box)")
    ap.add_argument("--ops", default="", help="comma-separated op names to time (default: all)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                    help="time torch.compile of each eager composition too (kernels=compile)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    if not _ext.load():
        sys.stderr.write("trainer._C is not built: run `make install`\n")
        return 1
    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.stderr.write("--device cuda: no CUDA device is available\n")
        return 1
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    devices = [d for d in devices if d == "cpu" or torch.cuda.is_available()]
    only = tuple(op for op in args.ops.split(",") if op)
    for device in devices:
        scale = args.scale if args.scale is not None else (0.5 if device == "cpu" else 8.0)
        reps = args.reps if args.reps is not None else (15 if device == "cpu" else 20)
        tokens = max(16, int(2048 * scale))
        text = ""
        for name in args.dtypes.split(","):
            dtype = getattr(torch, name)
            text += render(device, dtype, tokens, run(device, dtype, tokens, reps, only, args.compile)) + "\n"
        sys.stdout.write(text)
        os.makedirs(args.out, exist_ok=True)
        # A subset run (--ops) keeps the full table's file: it goes to kernels_<device>_<ops>.txt.
        suffix = "_" + "-".join(only) if only else ""
        with open(os.path.join(args.out, f"kernels_{device}{suffix}.txt"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
