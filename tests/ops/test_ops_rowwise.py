"""Scale+causal-mask+softmax and LayerNorm: csrc ops against the eager reference, gradcheck, opcheck."""

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

# [..., sq, sk]: square, odd, sq < sk (queries are the last sq positions), one row, a 4-D attention shape.
SOFTMAX_SHAPES = [(5, 5), (3, 7, 13), (2, 3, 17), (1, 1, 1), (2, 4, 64, 64)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SOFTMAX_SHAPES)
def test_scaled_causal_softmax_matches_reference(device, dtype, shape):
    scale = 0.37
    s = rand(shape, dtype, device, requires_grad=True)
    y = fused.scaled_causal_softmax(s, scale)
    sr = s.detach().float().requires_grad_()
    yr = reference.scaled_causal_softmax(sr, scale)
    assert y.dtype == dtype
    assert_close(y, yr, dtype)
    g = rand(shape, dtype, device)
    y.backward(g)
    yr.backward(g.float())
    assert_close(s.grad, sr.grad, dtype)
    sq, sk = shape[-2:]
    future = torch.ones(sq, sk, dtype=torch.bool, device=device).triu(sk - sq + 1)
    assert (y[..., future] == 0).all() and (s.grad[..., future] == 0).all()


def test_scaled_causal_softmax_non_contiguous_input():
    s = torch.randn(2, 9, 9).transpose(-1, -2)
    assert not s.is_contiguous()
    torch.testing.assert_close(fused.scaled_causal_softmax(s, 0.5), reference.scaled_causal_softmax(s, 0.5))


def test_scaled_causal_softmax_gradcheck_double():
    s = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: fused.scaled_causal_softmax(t, 0.8), (s,))


LN_SHAPES = [(3, 5), (2, 7, 33), (16, 768), (1, 2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", LN_SHAPES)
def test_layer_norm_matches_reference(device, dtype, shape):
    h = shape[-1]
    x = (rand(shape, torch.float32, device) * 3 + 5).to(dtype).requires_grad_()  # a mean far from 0
    w = rand((h,), dtype, device, requires_grad=True)
    b = rand((h,), dtype, device, requires_grad=True)
    y = fused.layer_norm(x, w, b, 1e-5)
    xr, wr, br = (t.detach().float().requires_grad_() for t in (x, w, b))
    yr = reference.layer_norm(xr, wr, br, 1e-5)
    assert y.dtype == dtype
    assert_close(y, yr, dtype)
    g = rand(shape, dtype, device)
    y.backward(g)
    yr.backward(g.float())
    assert_close(x.grad, xr.grad, dtype)
    assert_close(w.grad, wr.grad, dtype, scale=PARAM_GRAD_SCALE)
    assert_close(b.grad, br.grad, dtype, scale=PARAM_GRAD_SCALE)


def test_layer_norm_stats_are_fp32_and_params_may_be_fp32():
    x = torch.randn(4, 24).bfloat16()
    w, b = torch.randn(24, requires_grad=True), torch.randn(24, requires_grad=True)
    y, mean, rstd = torch.ops.slipway.layer_norm(x, w, b, 1e-5)
    assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == (4,)
    torch.testing.assert_close(mean, x.float().mean(-1))
    fused.layer_norm(non_contiguous(x), w, b, 1e-5).float().sum().backward()
    assert w.grad.dtype == torch.float32


def test_layer_norm_gradcheck_double():
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: fused.layer_norm(*a, 1e-5), (x, w, b))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_rowwise(device):
    ops = torch.ops.slipway
    s = torch.randn(2, 6, 6, device=device, requires_grad=True)
    torch.library.opcheck(ops.scaled_causal_softmax, (s, 0.5))
    y = ops.scaled_causal_softmax(s.detach(), 0.5)
    torch.library.opcheck(ops.scaled_causal_softmax_backward, (torch.randn_like(y), y, 0.5))
    x = torch.randn(5, 12, device=device, requires_grad=True)
    w = torch.randn(12, device=device, requires_grad=True)
    b = torch.randn(12, device=device, requires_grad=True)
    torch.library.opcheck(ops.layer_norm, (x, w, b, 1e-5))
    _, mean, rstd = ops.layer_norm(x.detach(), w.detach(), b.detach(), 1e-5)
    torch.library.opcheck(ops.layer_norm_backward, (torch.randn(5, 12, device=device), x.detach(), w.detach(),
                                                    mean, rstd))
