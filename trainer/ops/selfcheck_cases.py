"""The self-check's test cases: each fused op on small random inputs shaped like the model's, against its
eager reference in fp32 (trainer.ops.selfcheck runs them and decides).

A case holds the op's arguments in the run's dtypes and says which get gradients; the reference sees the
same values upcast to fp32 (fp64 stays fp64), so the comparison measures the fused op's error against the
exact composition, as tests/ops does. Arguments are laid out as the model lays them out (a rotary input
that is a permuted view, padded logits with the true vocabulary passed, as the head calls the loss), so a
kernel that is wrong only for strided input or for the model's widths is caught. Shapes come from
:class:`CheckShapes`; only a few rows are used, so the check costs milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from trainer.config import ModelConfig

# Tolerances (rtol, atol) per activation dtype, against the reference evaluated in fp32 on the same
# (low-precision) inputs: the fused op computes in fp32 and rounds once, so it may differ by about one
# rounding of the output dtype (bf16: 2^-8 relative, fp16: 2^-11) plus fp32 noise; atol is relative to the
# reference's magnitude. tests/ops uses the same table.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float64: (1e-10, 1e-10),
}
# A parameter's gradient is a sum over rows of rounded terms: allowed 4x the elementwise error.
PARAM_GRAD_SCALE = 4.0
ROWS = 8  # rows (tokens) per case: every kernel's per-row path, at the model's widths
DROPOUT_P = 0.5  # the dropout structure check's probability (half the elements dropped)


@dataclass(frozen=True)
class CheckShapes:
    """The widths this rank's kernels see (per tensor-parallel rank, as the layers shard them)."""

    hidden: int
    ffn: int  # MLP inner width on this rank (the gated MLP's first matmul makes 2x this)
    heads: int  # attention heads on this rank
    head_dim: int
    rotary_dim: int  # 0: no rope
    seq: int
    vocab: int  # the true vocabulary (the loss slices the padded logits to it)
    padded_vocab: int
    eps: float

    @classmethod
    def for_model(cls, model: ModelConfig, tp_size: int, padded_vocab: int) -> CheckShapes:
        """From the model section (vocab_size resolved) and the layout's tensor-parallel size."""
        return cls(hidden=model.hidden_size, ffn=max(model.ffn_hidden_size // tp_size, 1),
                   heads=max(model.num_attention_heads // tp_size, 1), head_dim=model.head_dim,
                   rotary_dim=model.rotary_dim, seq=model.seq_length, vocab=int(model.vocab_size),
                   padded_vocab=padded_vocab, eps=model.norm_epsilon)


@dataclass
class Case:
    """One call of an op: ``call(fn, *args)`` (default ``fn(*args)``); ``grad``: indices of the args that
    get gradients; ``param``: those that are parameters (their gradient is a sum over rows)."""

    args: list
    grad: tuple[int, ...]
    param: tuple[int, ...] = ()
    call: Callable | None = None
    name: str = ""

    def run(self, fn: Callable, args: list) -> torch.Tensor:
        return fn(*args) if self.call is None else self.call(fn, *args)


@dataclass
class Inputs:
    """Random inputs from one seeded CPU generator (the same values on every device), moved to the
    device: activations in ``dtype``, parameters in ``param_dtype``."""

    device: torch.device
    dtype: torch.dtype
    param_dtype: torch.dtype
    gen: torch.Generator = field(default_factory=torch.Generator)

    def act(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = torch.randn(shape, generator=self.gen, dtype=torch.float32)
        return t.to(device=self.device, dtype=dtype or self.dtype)

    def param(self, *shape: int, around: float = 0.0) -> torch.Tensor:
        return (around + self.act(*shape, dtype=torch.float32)).to(self.param_dtype)


def _rotary_call(fn: Callable, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # The model rotates q [b, heads, s, d] that is a permuted view of the QKV projection [s, b, ..., d].
    return fn(x.permute(1, 2, 0, 3), cos, sin)


def _loss_call(vocab: int) -> Callable:
    def call(fn: Callable, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return fn(logits, target, vocab_size=vocab)  # the padded columns left out, as LMHead calls it

    return call


def _rotary_tables(s: CheckShapes, inp: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    half = torch.rand((ROWS, s.rotary_dim // 2), generator=inp.gen) * (2 * math.pi)
    angles = torch.cat((half, half), dim=-1).to(inp.device)  # rotate-half layout: angles repeated
    return angles.cos(), angles.sin()


def op_cases(op: str, s: CheckShapes, inp: Inputs) -> list[Case]:
    """The cases of ``op`` (trainer.ops.OPS), or [] for ops this function does not cover."""
    r, h = ROWS, s.hidden
    if op == "bias_gelu":
        return [Case([inp.act(r, s.ffn), inp.param(s.ffn)], grad=(0, 1), param=(1,))]
    if op == "bias_dropout_add":  # the residual stream is in the activations' dtype, the bias a parameter
        return [Case([inp.act(r, h), inp.param(h), inp.act(r, h), 0.0, False], grad=(0, 1, 2), param=(1,))]
    if op == "scaled_causal_softmax":  # the model's key length; a few query rows (the last ones)
        q = min(r, s.seq)
        return [Case([inp.act(1, 1, q, s.seq), s.head_dim ** -0.5], grad=(0,))]
    if op == "layer_norm":
        return [Case([inp.act(r, h), inp.param(h, around=1.0), inp.param(h), s.eps], grad=(0, 1, 2),
                     param=(1, 2))]
    if op == "rms_norm":
        return [Case([inp.act(r, h), inp.param(h, around=1.0), s.eps], grad=(0, 1), param=(1,))]
    if op == "swiglu":
        return [Case([inp.act(r, 2 * s.ffn)], grad=(0,))]
    if op == "rotary" and s.rotary_dim:
        cos, sin = _rotary_tables(s, inp)
        return [Case([inp.act(r, 1, s.heads, s.head_dim), cos, sin], grad=(0,), call=_rotary_call)]
    if op == "rotary":  # no rope in this model: a head-sized rotation still exercises the kernel
        return op_cases(op, CheckShapes(**{**s.__dict__, "rotary_dim": s.head_dim - s.head_dim % 2}), inp)
    if op == "cross_entropy":
        target = torch.randint(0, s.vocab, (r,), generator=inp.gen).to(inp.device)
        return [Case([inp.act(r, s.padded_vocab), target], grad=(0,), call=_loss_call(s.vocab))]
    return []
