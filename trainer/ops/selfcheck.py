"""Kernel self-check at job start: a wrong fused kernel never trains (``train.kernel_check``).

Before the model is built, every op of the resolved :class:`~trainer.ops.KernelSet` whose implementation
is not the eager reference (csrc, apex, compile) runs once, forward and backward, on the job's own device
and dtypes, on small random inputs shaped like the model's (trainer.ops.selfcheck_cases), against the
eager reference in fp32. Why at every start and not only in tests: the kernels that train are the ones
built for this node's GPU, driver and image, which no test of ours ever ran; an op compiled for the wrong
architecture, or miscompiled, fails here in milliseconds instead of corrupting weeks of training.

Per op the worst ratio error / tolerance over its outputs and input gradients decides (tolerances per
dtype: selfcheck_cases.TOLERANCES, the table tests/ops uses). An op that raises counts as infinitely
wrong. The ranks agree: every rank's ratios are gathered and an op that fails on any rank falls back on
all (replicated parameters must see the same kernel everywhere, or they drift apart). Policies:

- ``fallback`` (default): the failing ops use the eager reference for this run; one warning per op names
  it, its implementation, the max error, the tolerance, the dtype and the rank; the record goes to the
  metrics file, the log lines, ``status`` and the summary.
- ``fail``: stop before the first step (:class:`KernelCheckError`, a ValueError: the job is not retried,
  a retry would repeat it), naming the ops. For CI of a site image.
- ``off``: no check.

The global RNG states are saved and restored around the check: a checked run draws exactly the random
numbers an unchecked one does.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trainer.log import get_logger
from trainer.ops import KernelSet, reference
from trainer.ops.selfcheck_cases import (
    DROPOUT_P,
    PARAM_GRAD_SCALE,
    ROWS,
    TOLERANCES,
    Case,
    CheckShapes,
    Inputs,
    op_cases,
)

log = get_logger(__name__)

EAGER = "eager"
CHECK_SEED = 20261203


class KernelCheckError(ValueError):
    """train.kernel_check=fail and a fused op disagreed with its reference (a retry would repeat it)."""


@dataclass
class OpResult:
    """One op's verdict: the worst element over every dtype, output and gradient checked."""

    op: str
    impl: str
    ratio: float = 0.0  # max |error| / tolerance at the worst element; > 1 fails, inf: raised
    max_error: float = 0.0
    tolerance: float = 0.0
    dtype: str = ""  # where the worst element was found
    what: str = ""  # "output" or "grad of argument i"
    error: str = ""  # the exception, when the op raised
    rank: int = 0  # the rank that saw the worst ratio (after agreement: the job's worst)

    @property
    def ok(self) -> bool:
        return self.ratio <= 1.0

    def worse(self, ratio: float, max_error: float, tolerance: float, where: tuple[str, str]) -> None:
        if not ratio <= self.ratio:  # NaN counts as worse
            self.ratio, self.max_error, self.tolerance = ratio, max_error, tolerance
            self.dtype, self.what = where

    def describe(self) -> str:
        if self.error:
            return f"{self.op} ({self.impl}) raised on rank {self.rank}: {self.error}"
        return (f"{self.op} ({self.impl}) on rank {self.rank}, {self.dtype} {self.what}: max error "
                f"{self.max_error:.3g} > tolerance {self.tolerance:.3g}")


@dataclass
class KernelCheck:
    """What the check found, and the kernel set the run uses after it."""

    policy: str
    kernels: KernelSet
    device: str = ""
    dtypes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    results: list[OpResult] = field(default_factory=list)

    @property
    def fallbacks(self) -> list[str]:
        return [r.op for r in self.results if not r.ok]

    def record(self) -> dict:
        """The JSON form (the metrics file's ``kernel_check`` record; trainer.metrics_file)."""
        return {"policy": self.policy, "device": self.device, "dtypes": self.dtypes,
                "seconds": round(self.seconds, 4), "checked": {r.op: r.impl for r in self.results},
                "fallbacks": [{"op": r.op, "impl": r.impl, "max_error": _finite(r.max_error),
                               "tolerance": r.tolerance, "dtype": r.dtype, "what": r.what, "rank": r.rank,
                               "error": r.error} for r in self.results if not r.ok]}


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _deviation(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
               scale: float = 1.0) -> tuple[float, float, float]:
    """(ratio, |error|, tolerance) at the element worst relative to its tolerance, |a − e| ≤ atol·mag·scale
    + rtol·|e| (torch.testing.assert_close's rule, atol relative to the reference's magnitude)."""
    if actual.shape != expected.shape:
        return math.inf, math.inf, 0.0
    rtol, atol = TOLERANCES[dtype]
    a, e = actual.detach().double(), expected.detach().double()
    if e.numel() == 0:
        return 0.0, 0.0, 0.0
    mag = max(1.0, float(e.abs().max()))
    allowed = atol * mag * scale + rtol * e.abs()
    diff = (a - e).abs().nan_to_num(nan=math.inf)
    ratio = diff / allowed
    i = int(ratio.flatten().argmax())
    return float(ratio.flatten()[i]), float(diff.flatten()[i]), float(allowed.flatten()[i])


def _prep(x: object, i: int, case: Case, upcast: bool) -> object:
    if not (torch.is_tensor(x) and x.is_floating_point()):
        return x
    t = x.detach().to(torch.promote_types(x.dtype, torch.float32)) if upcast else x.detach().clone()
    return t.requires_grad_(i in case.grad)


def _backward(out: torch.Tensor, g: torch.Tensor) -> None:
    """out.backward(g) as the backward of a scalar: ``backward`` with an explicit gradient imports sympy
    on first use (torch's shape check), 0.6 s of start-up a job would pay for the check alone."""
    (out.float() * g.float()).sum().backward()


def _check_case(fn, ref, case: Case, inp: Inputs, result: OpResult) -> None:
    """Forward and backward of one case against the reference; the worst ratio goes into ``result``."""
    mine = [_prep(x, i, case, False) for i, x in enumerate(case.args)]
    exact = [_prep(x, i, case, True) for i, x in enumerate(case.args)]
    out, want = case.run(fn, mine), case.run(ref, exact)
    dtype, name = inp.dtype, str(inp.dtype).removeprefix("torch.")
    result.worse(*_deviation(out, want, dtype), (name, "output"))
    if not case.grad:
        return
    g = inp.act(*out.shape, dtype=out.dtype)
    _backward(out, g)
    _backward(want, g)
    for i in case.grad:
        scale = PARAM_GRAD_SCALE if i in case.param else 1.0
        if mine[i].grad is None:
            result.worse(math.inf, math.inf, 0.0, (name, f"no gradient for argument {i}"))
            continue
        result.worse(*_deviation(mine[i].grad, exact[i].grad, dtype, scale), (name, f"grad of argument {i}"))


def _check_dropout(fn, inp: Inputs, result: OpResult, shapes: CheckShapes) -> None:
    """Dropout masks are random, so with p > 0 the structure is checked: every element of the output is
    0 or x/(1 − p), about half are kept, and the gradient of x is g/(1 − p) exactly where the forward kept
    the element (the csrc kernels regenerate the mask in backward). Bias and residual are zero and
    |x| ≥ 0.5, so a kept element can never pass for a dropped one after rounding (the p = 0 case checks
    the bias and residual paths)."""
    n = inp.act(ROWS * 16, shapes.hidden, dtype=torch.float32)
    x = (n.sign() * (0.5 + n.abs())).to(inp.dtype).requires_grad_()
    bias = torch.zeros(shapes.hidden, device=inp.device, dtype=inp.param_dtype)
    out = fn(x, bias, torch.zeros_like(x), DROPOUT_P, True)
    dy = out.detach().double()
    kept_value = x.detach().double() / (1 - DROPOUT_P)
    kept = (dy - kept_value).abs() < dy.abs()
    name = str(inp.dtype).removeprefix("torch.")
    result.worse(*_deviation(torch.where(kept, dy, 0.0), torch.where(kept, kept_value, 0.0), inp.dtype),
                 (name, f"dropout p={DROPOUT_P} output"))
    share = float(kept.double().mean())
    if not 0.35 < share < 0.65:
        result.worse(math.inf, abs(share - (1 - DROPOUT_P)), 0.15, (name, f"dropout keeps {share:.2f}"))
    g = inp.act(*out.shape, dtype=out.dtype)
    _backward(out, g)
    want = torch.where(kept, g.double() / (1 - DROPOUT_P), 0.0)
    result.worse(*_deviation(x.grad, want, inp.dtype), (name, "dropout grad of argument 0"))


def _check_adamw(fn, inp: Inputs, result: OpResult, shapes: CheckShapes) -> None:
    """Three AdamW steps on fp32 masters (grads scaled, decay on) against the reference; with 16-bit
    parameters the rounded model copies are compared too."""
    from trainer.ops.adamw import AdamWHyper, AdamWTensors

    hp = AdamWHyper(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_scale=0.5)
    sizes = [(ROWS, shapes.hidden), (shapes.hidden,)]
    masters = [inp.act(*s, dtype=torch.float32) for s in sizes]
    low = inp.param_dtype != torch.float32

    def state() -> AdamWTensors:
        zeros = [torch.zeros_like(p) for p in masters]
        model = [p.to(inp.param_dtype) for p in masters] if low else []
        return AdamWTensors([p.clone() for p in masters], list(zeros), [z.clone() for z in zeros],
                            [z.clone() for z in zeros], model)

    mine, exact = state(), state()
    for step in (1, 2, 3):
        grads = [inp.act(*s, dtype=inp.param_dtype if low else torch.float32) for s in sizes]
        mine.grads, exact.grads = grads, grads
        fn(mine, hp, step)
        reference.adamw_step(exact, hp, step)
    f32 = torch.float32
    for what, a, b, dtype in (("params", mine.params, exact.params, f32),
                              ("exp_avgs", mine.exp_avgs, exact.exp_avgs, f32),
                              ("exp_avg_sqs", mine.exp_avg_sqs, exact.exp_avg_sqs, f32),
                              ("model params", mine.model_params, exact.model_params, inp.param_dtype)):
        for x, y in zip(a, b, strict=True):
            result.worse(*_deviation(x, y, dtype), (str(dtype).removeprefix("torch."), what))


def check_op(op: str, fn, shapes: CheckShapes, inp: Inputs, result: OpResult) -> None:
    """Every case of ``op`` on ``inp``'s device and dtypes; an exception is an infinite error."""
    try:
        if op == "adamw_step":
            _check_adamw(fn, inp, result, shapes)
            return
        for case in op_cases(op, shapes, inp):
            _check_case(fn, getattr(reference, op), case, inp, result)
        if op == "bias_dropout_add":
            _check_dropout(fn, inp, result, shapes)
    except Exception as e:  # noqa: BLE001 - a kernel that raises is exactly what this must catch
        result.ratio, result.max_error, result.tolerance = math.inf, math.inf, 0.0
        result.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def _fused_ops(kernels: KernelSet) -> list[str]:
    return [op for op, impl in kernels.names.items() if impl != EAGER]


@dataclass(frozen=True)
class CheckSetup:
    """Where and how the kernels will run: device, activation dtypes, the parameters' dtype, shapes."""

    device: torch.device
    dtypes: tuple[torch.dtype, ...]
    param_dtype: torch.dtype
    shapes: CheckShapes


def measure(kernels: KernelSet, setup: CheckSetup) -> list[OpResult]:
    """This rank's verdict for every fused op of ``kernels`` (the global RNG is left as it was)."""
    results = []
    devices = [setup.device] if setup.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=setup.device.type):
        for op in _fused_ops(kernels):
            result = OpResult(op, kernels.names[op])
            for dtype in setup.dtypes:
                inp = Inputs(setup.device, dtype, setup.param_dtype)
                inp.gen.manual_seed(CHECK_SEED)
                check_op(op, getattr(kernels, op), setup.shapes, inp, result)
            results.append(result)
    return results


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def agree(results: list[OpResult]) -> list[OpResult]:
    """Every rank's verdicts gathered; each op takes the worst rank's (its error text too), so all ranks
    fall back on the same ops and rank 0 can name where and why. Keyed by op: a rank whose build lacks a
    fused op (it runs eager there) still learns that another rank's version of it failed. Every rank
    must call this (a collective), also with no fused op of its own."""
    mine = [dataclasses.replace(r, rank=_rank()) for r in results]
    if _world() == 1:
        return mine
    gathered: list = [None] * _world()
    dist.all_gather_object(gathered, mine)  # a few hundred bytes per rank, once per job

    def badness(r: OpResult) -> float:
        return math.inf if math.isnan(r.ratio) else r.ratio

    by_op: dict[str, list[OpResult]] = {}
    for theirs in gathered:
        for r in theirs:
            by_op.setdefault(r.op, []).append(r)
    return [max(rs, key=badness) for rs in by_op.values()]


def with_eager(kernels: KernelSet, ops: list[str]) -> KernelSet:
    """``kernels`` with ``ops`` replaced by their eager references."""
    names = {**kernels.names, **dict.fromkeys(ops, EAGER)}
    return dataclasses.replace(kernels, names=names, **{op: getattr(reference, op) for op in ops})


def run_check(kernels: KernelSet, setup: CheckSetup, policy: str) -> KernelCheck:
    """Check, agree across ranks, and apply ``policy`` (the module docstring); returns the checked set."""
    check = KernelCheck(policy, kernels, str(setup.device),
                        [str(d).removeprefix("torch.") for d in setup.dtypes])
    if policy == "off" or (not _fused_ops(kernels) and _world() == 1):
        return check  # with several ranks every one takes part in the agreement, fused ops or not
    t0 = time.perf_counter()
    check.results = agree(measure(kernels, setup))
    if setup.device.type == "cuda":
        torch.cuda.synchronize(setup.device)
    check.seconds = time.perf_counter() - t0
    bad = [r for r in check.results if not r.ok]
    where = f"{check.device} {'+'.join(check.dtypes)}"
    if not bad:
        if check.results:  # (none anywhere: kernels=eager on several ranks)
            log.info("kernel self-check: %d fused ops agree with their eager references on %s, forward and "
                     "backward, in %.3f s (%s)", len(check.results), where, check.seconds,
                     ", ".join(f"{r.op}={r.impl}" for r in check.results))
        return check
    if policy == "fail":
        return check  # the caller records it, then raises (fail_message)
    for r in bad if _rank() == 0 else []:  # the verdicts agree: one line per op for the job
        log.warning("kernel self-check: %s; using the eager %s for this run (train.kernel_check=fallback). "
                    "Fix: rebuild the kernels for this GPU and image (`make install`), or set kernels=eager",
                    r.describe(), r.op)
    check.kernels = with_eager(kernels, check.fallbacks)
    return check


def fail_message(check: KernelCheck) -> str:
    """Every failing op, and the fixes."""
    bad = "; ".join(r.describe() for r in check.results if not r.ok)
    return (f"kernel self-check failed on {check.device} ({'+'.join(check.dtypes)}): {bad}. Fix: rebuild the "
            f"kernels for this GPU and image (`make install`), or set kernels=eager")


def main(argv: list[str] | None = None) -> int:
    """``python -m trainer.ops.selfcheck``: the check alone, on this node (a site image's CI: exit 78 when
    an op fails, 0 when every fused op agrees); the verdict as JSON on stdout."""
    import argparse
    import json
    import os
    import sys

    from trainer.config import KERNEL_SETS, PRECISIONS, ModelConfig
    from trainer.ops import resolve
    from trainer.ops.dtypes import DTYPES
    from trainer.signals import EXIT_PERMANENT

    parser = argparse.ArgumentParser(prog="python -m trainer.ops.selfcheck", description=main.__doc__)
    parser.add_argument("--kernels", default="auto", choices=KERNEL_SETS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="bf16", choices=PRECISIONS)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (the widths each rank sees)")
    parser.add_argument("model", nargs="*", help="model.KEY=VALUE (default: CodeParrot-small, vocab 32768)")
    a = parser.parse_args(argv)
    fields: dict = {"vocab_size": 32768}
    for item in a.model:
        key, _, value = item.removeprefix("model.").partition("=")
        fields[key] = json.loads(value) if value[:1].isdigit() or value in ("true", "false") else value
    model = ModelConfig(**fields)
    dtypes = tuple(dict.fromkeys((DTYPES[a.precision], torch.float32)))
    setup = CheckSetup(torch.device(a.device), dtypes, torch.float32,
                       CheckShapes.for_model(model, a.tp, model.padded_vocab_size(a.tp)))
    from trainer import faults

    faults.warn_active(log, os.environ)
    kernels = faults.with_faults(resolve(a.kernels, torch.device(a.device).type))
    check = run_check(kernels, setup, "fail")
    sys.stdout.write(json.dumps(check.record(), indent=1) + "\n")
    if check.fallbacks:
        sys.stderr.write(fail_message(check) + "\n")
        return EXIT_PERMANENT
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
