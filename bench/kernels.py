"""Each fused csrc op against the eager composition it replaces, timed in the same process.

    python bench/kernels.py                 # CPU (and CUDA when present), prints a table
    python bench/kernels.py --device cuda --scale 1.0

Ratio = eager time / fused time (> 1: the fused op is faster), for forward and forward+backward, best of
--reps alternating runs after warm-up. Shapes are CodeParrot-small's (h=768, 12 heads, V=32768) with the token
count scaled by --scale (CPU default 0.5 of one 2×1024-token micro-batch). Results also go to
bench/results/kernels_<device>.txt with date, machine and versions.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.meta import commit, load  # noqa: E402
from trainer.ops import _ext, reference  # noqa: E402


@dataclass
class Case:
    name: str
    fused: Callable[[], torch.Tensor | None]
    eager: Callable[[], torch.Tensor | None]
    backward: bool = True


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _clock(device: str) -> Callable[[], float]:
    """CPU time of this thread on a single-threaded CPU run (the development boxes are shared: time spent
    descheduled is not the code's), else wall time (GPU work is measured after synchronising)."""
    return time.thread_time if device == "cpu" and torch.get_num_threads() == 1 else time.perf_counter


def timed_pair(a: Callable[[], object], b: Callable[[], object], device: str,
               reps: int) -> tuple[float, float]:
    """Best-of-reps seconds of a and b, run alternately so drifting machine load hits both alike.

    The minimum, not the median: the least-disturbed run measures the code rather than the neighbours.
    """
    clock = _clock(device)
    for fn in (a, b, a, b):
        fn()
    _sync(device)
    best = [float("inf"), float("inf")]
    for _ in range(reps):
        for i, fn in enumerate((a, b)):
            t0 = clock()
            fn()
            _sync(device)
            best[i] = min(best[i], clock() - t0)
    return best[0], best[1]


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


def cases(device: str, dtype: torch.dtype, tokens: int) -> list[Case]:
    from trainer.ops import adamw, cross_entropy, fused

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
    return [
        Case("bias_gelu", lambda: fused.bias_gelu(x4, b4), lambda: reference.bias_gelu(x4, b4)),
        Case("bias_dropout_add", lambda: fused.bias_dropout_add(x, b, res, 0.1, True),
             lambda: reference.bias_dropout_add(x, b, res, 0.1, True)),
        Case("scaled_causal_softmax", lambda: fused.scaled_causal_softmax(scores, 0.125),
             lambda: reference.scaled_causal_softmax(scores, 0.125)),
        Case("layer_norm", lambda: fused.layer_norm(xr, w, lb, 1e-5),
             lambda: reference.layer_norm(xr, w, lb, 1e-5)),
        Case("cross_entropy", lambda: cross_entropy.cross_entropy(logits, target),
             lambda: reference.cross_entropy(logits, target)),
        Case("rms_norm", lambda: fused.rms_norm(xn, wn, 1e-5), lambda: reference.rms_norm(xn, wn, 1e-5)),
        Case("swiglu", lambda: fused.swiglu(xg), lambda: reference.swiglu(xg)),
        Case("rotary", lambda: fused.rotary(q, cos, sin), lambda: reference.rotary(q, cos, sin)),
        _adamw_case(device, dtype, n_params, adamw),
    ]


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


def run(device: str, dtype: torch.dtype, tokens: int, reps: int, only: tuple[str, ...] = ()) -> list[tuple]:
    """(name, fused fwd, eager fwd, fused fwd+bwd, eager fwd+bwd) seconds per case (those in ``only``)."""
    rows = []
    for c in (c for c in cases(device, dtype, tokens) if not only or c.name in only):
        tf, te = timed_pair(c.fused, c.eager, device, reps)
        if c.backward:
            bf, be = timed_pair(_fwd_bwd(c.fused), _fwd_bwd(c.eager), device, reps)
        else:
            bf = be = float("nan")
        rows.append((c.name, tf, te, bf, be))
    return rows


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or platform.machine())


def render(device: str, dtype: torch.dtype, tokens: int, rows) -> str:
    head = (f"# bench/kernels.py  {datetime.datetime.now().isoformat(timespec='seconds')}  "
            f"commit {commit()}  load {load()}\n"
            f"# device={device} ({_device_name(device)}) "
            f"threads={torch.get_num_threads()} torch={torch.__version__} dtype={dtype} tokens={tokens}\n"
            f"# ratio = eager / fused (>1: fused faster); ms, best of alternating runs "
            f"({'thread CPU time' if _clock(device) is time.thread_time else 'wall time'})\n")
    lines = [f"{'op':<26}{'fused fwd':>11}{'eager fwd':>11}{'ratio':>8}{'fused f+b':>11}{'eager f+b':>11}"
             f"{'ratio':>8}"]
    for name, tf, te, bf, be in rows:
        lines.append(f"{name:<26}{tf * 1e3:>11.3f}{te * 1e3:>11.3f}{te / tf:>8.2f}{bf * 1e3:>11.3f}"
                     f"{be * 1e3:>11.3f}{be / bf:>8.2f}")
    dt = str(dtype).removeprefix("torch.").replace("float32", "fp32").replace("bfloat16", "bf16")
    lines += [f"#   {name}: {DTYPES[name].format(dt=dt)}" for name, *_ in rows]
    return head + "\n".join(lines) + "\n"


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
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args()
    if not _ext.load():
        sys.stderr.write("trainer._C is not built: run `make install`\n")
        return 1
    torch.set_num_threads(args.threads)
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
            text += render(device, dtype, tokens, run(device, dtype, tokens, reps, only)) + "\n"
        sys.stdout.write(text)
        os.makedirs(args.out, exist_ok=True)
        # A subset run (--ops) keeps the full table's file: it goes to kernels_<device>_<ops>.txt.
        suffix = "_" + "-".join(only) if only else ""
        with open(os.path.join(args.out, f"kernels_{device}{suffix}.txt"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
