"""RMSNorm, SwiGLU and the rotary apply: csrc ops against the eager reference, gradcheck, opcheck."""

from __future__ import annotations

import pytest
import torch

from tests.ops.helpers import DEVICES, DTYPES, assert_close, non_contiguous, rand
from trainer import extension as _ext
from trainer.ops import reference
from trainer.ops.selfcheck_cases import PARAM_GRAD_SCALE

pytestmark = pytest.mark.skipif(not _ext.load(),
                                reason="trainer._C not built (tests/ops/test_dispatch.py fails)")
if _ext.load():
    from trainer.ops import fused

RMS_SHAPES = [(3, 5), (2, 7, 33), (16, 768), (1, 2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", RMS_SHAPES)
def test_rms_norm_matches_reference(device, dtype, shape):
    h = shape[-1]
    x = (rand(shape, torch.float32, device) * 3 + 2).to(dtype).requires_grad_()  # a mean far from 0
    w = rand((h,), dtype, device, requires_grad=True)
    y = fused.rms_norm(x, w, 1e-5)
    xr, wr = (t.detach().float().requires_grad_() for t in (x, w))
    yr = reference.rms_norm(xr, wr, 1e-5)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, yr, dtype)
    g = rand(shape, dtype, device)
    y.backward(g)
    yr.backward(g.float())
    assert_close(x.grad, xr.grad, dtype)
    assert_close(w.grad, wr.grad, dtype, scale=PARAM_GRAD_SCALE)  # a sum over rows of rounded terms


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_fp32_weight_low_precision_x_like_autocast(dtype):
    """Under autocast the weight (a parameter) is fp32 and x bf16: the reference promotes to fp32 after
    rounding the normalised row to x's dtype, and the fused op gives the same dtype and values."""
    x = non_contiguous(torch.randn(6, 40).to(dtype)).requires_grad_()
    w = torch.randn(40, requires_grad=True)
    y = fused.rms_norm(x, w, 1e-6)
    yr = reference.rms_norm(x, w, 1e-6)
    assert y.dtype == yr.dtype == torch.float32
    assert_close(y, yr, dtype)
    # The same rounding order, not just the tolerance: almost every element is bit-equal (an rstd an ulp
    # apart may round a few normalised values the other way); without the rounding to x's dtype, none is.
    assert (y == yr).float().mean() > 0.9
    g = torch.randn(6, 40)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    gxr, gwr = torch.autograd.grad(yr, (x, w), g)
    assert gx.dtype == dtype and gw.dtype == torch.float32
    assert_close(gx, gxr, dtype)
    assert_close(gw, gwr, dtype, scale=PARAM_GRAD_SCALE)


def test_rms_norm_weight_dtype_promotes_like_eager():
    """x fp32 with a bf16 weight gives fp32 (x's dtype); bf16 x with an fp16 weight promotes to fp32; a
    promotion the kernels do not produce (fp64 weight, bf16 x) is refused with the fix."""
    x, w = torch.randn(3, 16, requires_grad=True), torch.randn(16).bfloat16().requires_grad_()
    y = fused.rms_norm(x, w, 1e-5)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, reference.rms_norm(x, w, 1e-5))
    y.sum().backward()
    assert w.grad.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    xb, wh = torch.randn(3, 16).bfloat16(), torch.randn(16).half()
    assert fused.rms_norm(xb, wh, 1e-5).dtype == reference.rms_norm(xb, wh, 1e-5).dtype == torch.float32
    with pytest.raises(RuntimeError, match="Fix: pass a weight"):
        fused.rms_norm(xb, torch.randn(16, dtype=torch.float64), 1e-5)


def test_ops_under_cpu_autocast_match_the_reference_under_autocast():
    """Inside torch.autocast the custom ops see the tensors as they come (bf16 activations, fp32 weight and
    tables) and give the reference's dtypes."""
    x, lin, w = torch.randn(2, 8, 32), torch.randn(64, 32), torch.randn(64)
    cos, sin = rope_tables(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x @ lin.t()  # bf16 under autocast
        assert h.dtype == torch.bfloat16
        q = h.view(2, 8, 4, 16).transpose(1, 2)  # [b, heads, s, d]
        calls = (("rms_norm", (h, w, 1e-6)), ("swiglu", (h,)), ("rotary", (q, cos, sin)))
        for op, args in calls:
            got, want = getattr(fused, op)(*args), getattr(reference, op)(*args)
            assert got.dtype == want.dtype, op
            assert_close(got, want, torch.bfloat16)


def test_rms_norm_saves_fp32_rstd():
    x = torch.randn(4, 24).bfloat16()
    y, rstd = torch.ops.slipway.rms_norm(x, torch.ones(24, dtype=torch.bfloat16), 1e-5)
    assert rstd.dtype == torch.float32 and rstd.shape == (4,)
    torch.testing.assert_close(rstd, torch.rsqrt(x.float().pow(2).mean(-1) + 1e-5))


def test_rms_norm_gradcheck_double():
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: fused.rms_norm(*a, 1e-5), (x, w))


SWIGLU_SHAPES = [(3, 10), (2, 7, 66), (4, 2 * 2048), (1, 2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SWIGLU_SHAPES)
def test_swiglu_matches_reference(device, dtype, shape):
    g = torch.Generator().manual_seed(hash(shape) % 1000)
    x = rand(shape, dtype, device, requires_grad=True, gen=g)
    y = fused.swiglu(x)
    xr = x.detach().float().requires_grad_()
    yr = reference.swiglu(xr)
    assert y.dtype == dtype and y.shape == (*shape[:-1], shape[-1] // 2)
    assert_close(y, yr, dtype)
    gy = rand(y.shape, dtype, device, gen=g)
    y.backward(gy)
    yr.backward(gy.float())
    assert_close(x.grad, xr.grad, dtype)


def test_swiglu_non_contiguous_and_extreme_gates():
    """Far into both tails of the gate the value and gradient are the reference's (autograd in fp64)."""
    gate = torch.tensor([[-200.0, -90.0, -20.0, -1.0, 0.0, 1.0, 20.0, 90.0, 200.0]])
    x = non_contiguous(torch.cat((gate, torch.full_like(gate, 1.5)), dim=-1)).requires_grad_()
    y = fused.swiglu(x)
    x64 = x.detach().double().requires_grad_()
    y64 = reference.swiglu(x64)
    torch.testing.assert_close(y, y64.float(), atol=1e-6, rtol=1e-6)
    (gx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    (gx64,) = torch.autograd.grad(y64, x64, torch.ones_like(y64))
    assert torch.isfinite(gx).all()
    torch.testing.assert_close(gx, gx64.float(), atol=1e-6, rtol=1e-6)


def test_swiglu_gradcheck_double():
    x = torch.randn(4, 10, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fused.swiglu, (x,))


def rope_tables(s: int, d_rot: int, device: str = "cpu", base: float = 10000.0):
    """cos, sin [s, d_rot] fp32 as the model builds them: each angle repeated for both halves."""
    inv_freq = 1.0 / base ** (torch.arange(0, d_rot, 2, dtype=torch.float32) / d_rot)
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1).to(device)
    return emb.cos(), emb.sin()


# (x shape [..., s, d], d_rot): q/k as the model calls it ([b, heads, s, d]), partial rotary
# (rotary_percent 0.5), a 3-D input, one position.
ROTARY_CASES = [((2, 4, 9, 16), 16), ((2, 3, 17, 64), 32), ((5, 12, 8), 8), ((1, 1, 1, 4), 4)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "d_rot"), ROTARY_CASES)
def test_rotary_matches_reference(device, dtype, shape, d_rot):
    cos, sin = rope_tables(shape[-2], d_rot, device)
    x = rand(shape, dtype, device, requires_grad=True)
    y = fused.rotary(x, cos, sin)
    xr = x.detach().float().requires_grad_()
    yr = reference.rotary(xr, cos, sin)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, yr, dtype)
    assert torch.equal(y[..., d_rot:], x.detach()[..., d_rot:])  # dims past d_rot pass through exactly
    g = rand(shape, dtype, device)
    y.backward(g)
    yr.backward(g.float())
    assert_close(x.grad, xr.grad, dtype)


def test_rotary_on_transposed_heads_and_tables_get_no_grad():
    """q as attention makes it: [b, s, heads, d] transposed to [b, heads, s, d] (read where it lies), and
    a last dim with stride 2 (copied first); gradients through both, none to the tables."""
    cos, sin = (t.requires_grad_() for t in rope_tables(9, 16))
    for q in (torch.randn(2, 9, 4, 16).transpose(1, 2), non_contiguous(torch.randn(2, 4, 9, 16))):
        q.requires_grad_()
        assert not q.is_contiguous()
        y = fused.rotary(q, cos, sin)
        yr = reference.rotary(q, cos, sin)
        torch.testing.assert_close(y, yr)
        g = torch.randn(2, 9, 4, 16).transpose(1, 2)  # a non-contiguous incoming gradient too
        torch.testing.assert_close(torch.autograd.grad(y, q, g)[0], torch.autograd.grad(yr, q, g)[0])
    fused.rotary(q, cos, sin).sum().backward()  # an expanded (stride-0) gradient
    torch.testing.assert_close(q.grad, torch.autograd.grad(reference.rotary(q, cos, sin).sum(), q)[0])
    assert cos.grad is None and sin.grad is None


def test_rotary_gradcheck_double_with_general_tables():
    """Random cos/sin (the halves differ): checks the transposed rotation in general, not just for
    tables whose halves repeat."""
    cos, sin = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: fused.rotary(t, cos, sin), (x,))


def test_rotary_rejects_mismatched_tables():
    cos, sin = rope_tables(8, 16)
    with pytest.raises(RuntimeError, match="cos and sin must both be"):
        fused.rotary(torch.randn(2, 9, 16), cos, sin)  # 9 positions, tables for 8
    with pytest.raises(RuntimeError, match="cos and sin must both be"):
        fused.rotary(torch.randn(2, 8, 8), cos, sin)  # d_rot 16 > d 8


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_llama(device):
    ops = torch.ops.slipway
    x = torch.randn(5, 12, device=device, requires_grad=True)
    w = torch.randn(12, device=device, requires_grad=True)
    torch.library.opcheck(ops.rms_norm, (x, w, 1e-5))
    torch.library.opcheck(ops.rms_norm, (x.detach().bfloat16().requires_grad_(), w, 1e-5))  # mixed dtypes
    _, rstd = ops.rms_norm(x.detach(), w.detach(), 1e-5)
    torch.library.opcheck(ops.rms_norm_backward, (torch.randn(5, 12, device=device), x.detach(), w.detach(),
                                                  rstd))
    torch.library.opcheck(ops.swiglu, (x,))
    torch.library.opcheck(ops.swiglu_backward, (torch.randn(5, 6, device=device), x.detach()))
    q = torch.randn(2, 3, 7, 16, device=device, requires_grad=True)
    cos, sin = rope_tables(7, 8, device)
    torch.library.opcheck(ops.rotary, (q, cos, sin))
    torch.library.opcheck(ops.rotary_backward, (torch.randn(2, 3, 7, 16, device=device), cos, sin))


def _llama_block(x, w, cos, sin):
    h = fused.rms_norm(x, w, 1e-6)
    q = fused.rotary(h.view(2, 8, 2, 16).transpose(1, 2), cos, sin)  # [b, heads, s, d]
    return fused.swiglu(q.transpose(1, 2).reshape(2, 8, 32)).sum()


def test_torch_compile_traces_llama_ops_without_graph_breaks():
    cos, sin = rope_tables(8, 16)
    results = []
    for compile_it in (True, False):
        x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        w = torch.randn(32, generator=torch.Generator().manual_seed(2), requires_grad=True)
        fn = torch.compile(_llama_block, fullgraph=True, backend="aot_eager") if compile_it else _llama_block
        out = fn(x, w, cos, sin)
        out.backward()
        results.append((out.detach(), x.grad, w.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)
