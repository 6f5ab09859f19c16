"""Dtype flow of one training micro-batch under the bf16 recipes: every op's output dtype and size.

A ``TorchDispatchMode`` records each op of one forward and backward through the real step
(``trainer.run.entry.build_components``: the recipe, the kernel set, the optimizer's layout; then
``trainer.parallel.train_step``) of a one-layer GPT, and two rules must hold:

- no tensor of at least one element per token is fp32 unless a row of :data:`FP32_ALLOWED` names it
  (per-token statistics, the loss, the gradients of fp32 parameters and the fp32 gradient buckets). An
  fp32 residual stream, an fp32 QKV projection (bf16 + fp32 bias), fp32 LayerNorm outputs or logits
  would each show up here; on main before issue 39 all of them did;
- no zero-filled tensor of activation size (tokens × hidden or more) is created: the backward of a slice
  or a select of the QKV projection writes a full-size zero tensor for each of q, k and v.

Shapes are chosen so that no parameter is as large as one activation (tokens × hidden = 12,288 elements;
the largest parameter, the 256 × 32 embedding, has 8,192). Attention: SDPA without attention dropout (on
CPU torch's flash kernel; with dropout its math fallback computes the scores in fp32, a CPU-only path: on
CUDA flash/cuDNN never materialise them) and the explicit-softmax path with dropout (Slipway's fused
scaled softmax). ``python -m tests.model.test_dtype_flow [autocast|master_weights]`` prints the whole
listing.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainer import extension as _ext
from trainer.config import RunConfig
from trainer.parallel import ParallelState, train_step
from trainer.run.entry import build_components

pytestmark = pytest.mark.skipif(not _ext.load(), reason="needs trainer._C (the csrc kernels the recipe runs)")

S, B, H, HEADS, VOCAB = 96, 4, 32, 4, 200
TOKENS = S * B
ACTIVATION = TOKENS * H  # elements of one [s, b, h] activation


@dataclass
class Row:
    op: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    backward: bool
    storage: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def __str__(self) -> str:
        return f"{'bwd' if self.backward else 'fwd'} {self.op:<48} {str(self.dtype):<15} {list(self.shape)}"


@dataclass
class Flow(TorchDispatchMode):
    """Every new tensor an op returns (outputs that alias an input — views, in-place ops — are skipped:
    they allocate nothing)."""

    rows: list[Row] = field(default_factory=list)
    backward: bool = False

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_ptr(t) for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            if _ptr(t) not in inputs and t.numel():
                self.rows.append(Row(str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket")
                                     else str(func), t.dtype, tuple(t.shape), self.backward, _ptr(t)))
        return out


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@dataclass(frozen=True)
class Context:
    """What the allowed-fp32 rules may look at."""

    param_shapes: frozenset
    bucket_storages: frozenset


# The one table of fp32 tensors of at least one element per token that a bf16 step may create: (what, why,
# rule). Everything else at that size must be bf16.
FP32_ALLOWED = (
    ("per-token statistics", "norm mean/rstd, the loss kernel's max / sum-exp / target logit and "
     "log-sum-exp, the per-token loss, and the zero gradients autograd gives unused statistics: one "
     "number per token (1/hidden of an activation), kept fp32 for accuracy",
     lambda r, c: r.numel == TOKENS),
    ("attention log-sum-exp", "SDPA's flash kernels keep one fp32 log-sum-exp per (sequence, head, query) "
     "for backward", lambda r, c: r.numel == TOKENS * HEADS and "attention" in r.op),
    ("gradients of fp32 parameters", "autocast: the fp32 parameters' gradients (the bf16 weight gradient "
     "cast back, tied embedding gradients summed); master_weights: the fp32 main gradients",
     lambda r, c: r.shape in c.param_shapes),
    ("fp32 gradient buckets", "the flat gradient buffers (master gradients) themselves",
     lambda r, c: r.storage in c.bucket_storages),
)

ZERO_FILLS = ("zeros", "zeros_like", "new_zeros", "full", "full_like", "slice_backward", "select_backward",
              "fill")


def _config(recipe: str, backend: str) -> RunConfig:
    return RunConfig.from_dict({
        "model": {"num_layers": 1, "hidden_size": H, "num_attention_heads": HEADS, "seq_length": S,
                  "vocab_size": VOCAB, "hidden_dropout": 0.1,
                  "attention_dropout": 0.1 if backend == "softmax" else 0.0, "attention_backend": backend},
        "train": {"precision": "bf16", "precision_recipe": recipe, "micro_batch_size": B, "device": "cpu",
                  "kernel_check": "off"},
        "kernels": "csrc", "run_dir": "/nonexistent/dtype-flow",
    })


def record(recipe: str, backend: str) -> tuple[Flow, Context]:
    """One micro-batch (forward, backward, gradient sync) through the run's own components."""
    torch.manual_seed(0)
    parts = build_components(_config(recipe, backend), ParallelState.single())
    model = parts.model
    tokens = torch.randint(0, VOCAB, (B, S))
    batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, dims=1)}
    flow = Flow()

    def mark_backward(grad):  # the loss's backward starts: every op from here on is backward
        flow.backward = True
        return grad

    def on_logits(module, inputs, out) -> None:
        out.register_hook(mark_backward)

    hook = model.module.lm_head.register_forward_hook(on_logits)
    try:
        with flow:
            train_step(model, [batch])
    finally:
        hook.remove()
    ctx = Context(frozenset(tuple(p.shape) for p in model.parameters()),
                  frozenset(_ptr(b.buffer) for b in model.grads.buckets))
    return flow, ctx


def fp32_leaks(flow: Flow, ctx: Context) -> list[Row]:
    return [r for r in flow.rows if r.dtype == torch.float32 and r.numel >= TOKENS
            and not any(rule(r, ctx) for _, _, rule in FP32_ALLOWED)]


def zero_fills(flow: Flow) -> list[Row]:
    return [r for r in flow.rows if r.numel >= ACTIVATION and any(z in r.op for z in ZERO_FILLS)]


@pytest.mark.parametrize("backend", ["sdpa", "softmax"])
@pytest.mark.parametrize("recipe", ["autocast", "master_weights"])
def test_bf16_step_keeps_activations_bf16(recipe, backend):
    flow, ctx = record(recipe, backend)
    assert any(r.backward for r in flow.rows) and any(not r.backward for r in flow.rows)
    bf16 = [r for r in flow.rows if r.dtype == torch.bfloat16 and r.numel >= ACTIVATION]
    assert len(bf16) > 10, "the step made almost no bf16 activations: is the recipe applied at all?"
    leaks = fp32_leaks(flow, ctx)
    assert not leaks, (f"{len(leaks)} fp32 tensor(s) of at least one element per token that FP32_ALLOWED "
                       "does not name (" + recipe + ", " + backend + "):\n" + "\n".join(map(str, leaks)))
    fills = zero_fills(flow)
    assert not fills, "activation-sized zero-filled tensors:\n" + "\n".join(map(str, fills))


def test_the_rules_catch_what_they_are_for():
    """The checks are not vacuous: an fp32 [s, b, h] tensor (a promoted residual) and the slice backward
    of a bf16 [s, b, 3h] projection are both reported."""
    flow = Flow()
    x = torch.randn(S, B, 3 * H, dtype=torch.bfloat16, requires_grad=True)
    with flow:
        y = x[..., :H].float() + 1.0  # a promotion, and a slice whose backward zero-fills x's shape
        flow.backward = True
        y.sum().backward()
    ctx = Context(frozenset(), frozenset())
    assert any(r.shape == (S, B, H) for r in fp32_leaks(flow, ctx))
    assert any(r.op == "slice_backward" for r in zero_fills(flow))


if __name__ == "__main__":
    which = sys.argv[1:] or ["autocast"]
    for recipe in which:
        for backend in ("sdpa", "softmax"):
            flow, ctx = record(recipe, backend)
            print(f"== {recipe}, attention {backend}: {len(flow.rows)} new tensors")
            print("\n".join(map(str, flow.rows)))
            print("fp32 leaks:", len(fp32_leaks(flow, ctx)), " zero fills:", len(zero_fills(flow)))
