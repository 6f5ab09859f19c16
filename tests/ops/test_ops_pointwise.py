"""bias+GeLU and bias+dropout+residual: csrc ops against the eager reference, gradcheck, opcheck."""

from __future__ import annotations

import pytest
import torch

from tests.ops.helpers import DEVICES, DTYPES, assert_close, non_contiguous, rand
from trainer.ops import _ext, reference

pytestmark = pytest.mark.skipif(not _ext.load(),
                                reason="trainer._C not built (tests/ops/test_dispatch.py fails)")
if _ext.load():
    from trainer.ops import fused

SHAPES = [(3, 5), (2, 7, 33), (4, 3072), (1, 1)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_bias_gelu_matches_reference(device, dtype, shape):
    g = torch.Generator().manual_seed(hash(shape) % 1000)
    x = rand(shape, dtype, device, requires_grad=True, gen=g)
    b = rand(shape[-1:], dtype, device, requires_grad=True, gen=g)
    y = fused.bias_gelu(x, b)
    xr, br = x.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    yr = reference.bias_gelu(xr, br)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, yr, dtype)
    gy = rand(shape, dtype, device, gen=g)
    y.backward(gy)
    yr.backward(gy.float())
    assert_close(x.grad, xr.grad, dtype)
    assert_close(b.grad, br.grad, dtype, scale=4.0)  # a sum over rows of rounded terms


def test_bias_gelu_fp32_bias_with_bf16_input_and_non_contiguous():
    """Under autocast the bias (a parameter) stays fp32 while x is bf16: the op rounds once, to x's dtype."""
    x = non_contiguous(torch.randn(6, 40).bfloat16())
    b = torch.randn(40, requires_grad=True)
    y = fused.bias_gelu(x, b)
    assert y.dtype == torch.bfloat16
    assert_close(y, reference.bias_gelu(x.float(), b.detach()), torch.bfloat16)
    y.float().sum().backward()
    assert b.grad.dtype == torch.float32


def test_bias_gelu_gradcheck_double():
    x = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    b = torch.randn(9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(fused.bias_gelu, (x, b))


def test_bias_gelu_extreme_inputs_saturate_cleanly():
    x = torch.tensor([[-200.0, -20.0, 0.0, 20.0, 200.0]])
    y = fused.bias_gelu(x, torch.zeros(5))
    torch.testing.assert_close(y, reference.bias_gelu(x, torch.zeros(5)), atol=1e-6, rtol=1e-6)
    gx = torch.ops.slipway.bias_gelu_backward(torch.ones_like(x), x, torch.zeros(5))
    assert torch.isfinite(gx).all()


def _dropout_out(x, b, r, p, seed):
    return torch.ops.slipway.bias_dropout_add(x, b, r, p, torch.tensor([seed], device=x.device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_dropout_add_eval_equals_reference(device, dtype):
    x, r = rand((3, 7, 65), dtype, device), rand((3, 7, 65), dtype, device)
    b = rand((65,), dtype, device)
    out = fused.bias_dropout_add(x, b, r, 0.3, training=False)
    assert_close(out, reference.bias_dropout_add(x.float(), b.float(), r.float(), 0.3, False), dtype)
    out_nobias = fused.bias_dropout_add(x, None, r, 0.0, training=True)
    assert_close(out_nobias, x.float() + r.float(), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_dropout_add_training_mask_and_grads(device, dtype):
    p, shape = 0.25, (8, 31, 64)
    x = rand(shape, dtype, device, requires_grad=True)
    b = rand((64,), dtype, device, requires_grad=True)
    r = rand(shape, dtype, device, requires_grad=True)
    seed = torch.tensor([12345], device=device)
    out = torch.ops.slipway.bias_dropout_add(x, b, r, p, seed)
    # The mask depends only on (seed, element index): read it off the op applied to ones.
    ones, zeros = torch.ones(shape, device=device), torch.zeros(shape, device=device)
    mask = torch.ops.slipway.bias_dropout_add(ones, None, zeros, p, seed)  # 0 or 1/(1-p)
    vals = mask.unique().tolist()
    assert len(vals) == 2 and vals[0] == 0.0 and vals[1] == pytest.approx(1 / (1 - p))
    frac = (mask == 0).float().mean().item()
    assert abs(frac - p) < 0.03, f"drop fraction {frac} far from p={p}"
    expected = r.detach().float() + (x.detach().float() + b.detach().float()) * mask
    assert_close(out, expected, dtype)
    g = rand(shape, dtype, device)
    out.backward(g)
    assert_close(x.grad, g.float() * mask, dtype)
    assert_close(r.grad, g.float(), dtype)
    assert_close(b.grad, (g.float() * mask).sum((0, 1)), dtype, scale=4.0)


def test_bias_dropout_add_mixed_dtypes_promote_like_eager():
    """bf16 branch output + fp32 bias + fp32 residual (autocast with fp32 params) gives fp32, like eager."""
    x = torch.randn(5, 16).bfloat16().requires_grad_()
    b = torch.randn(16, requires_grad=True)
    r = torch.randn(5, 16, requires_grad=True)
    out = fused.bias_dropout_add(x, b, r, 0.0, training=True)
    ref = reference.bias_dropout_add(x, b, r, 0.0, True)
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref)
    out.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and b.grad.dtype == torch.float32 and r.grad.dtype == torch.float32


def test_dropout_rng_comes_from_torch_generator():
    """The seed is drawn from torch's default generator: torch.manual_seed (and the RNG tracker, which forks
    that state) reproduces the mask; a different state changes it."""
    x, r, b = torch.randn(64, 128), torch.randn(64, 128), torch.randn(128)
    torch.manual_seed(7)
    a1 = fused.bias_dropout_add(x, b, r, 0.5, True)
    a2 = fused.bias_dropout_add(x, b, r, 0.5, True)
    torch.manual_seed(7)
    a3 = fused.bias_dropout_add(x, b, r, 0.5, True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(8)
        a4 = fused.bias_dropout_add(x, b, r, 0.5, True)
    a5 = fused.bias_dropout_add(x, b, r, 0.5, True)
    assert torch.equal(a1, a3) and not torch.equal(a1, a2) and not torch.equal(a1, a4)
    assert torch.equal(a5, a2)  # fork_rng restored the state the tracker forked from


def test_dropout_mask_independent_of_thread_split():
    x, r = torch.randn(257, 129), torch.randn(257, 129)
    n = torch.get_num_threads()
    a = _dropout_out(x, None, r, 0.4, 99)
    torch.set_num_threads(1)
    try:
        b = _dropout_out(x, None, r, 0.4, 99)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(a, b)


def test_bias_dropout_add_gradcheck_double():
    x = torch.randn(3, 11, dtype=torch.float64, requires_grad=True)
    b = torch.randn(11, dtype=torch.float64, requires_grad=True)
    r = torch.randn(3, 11, dtype=torch.float64, requires_grad=True)
    seed = torch.tensor([5])
    assert torch.autograd.gradcheck(lambda *a: torch.ops.slipway.bias_dropout_add(*a, 0.3, seed), (x, b, r))


@pytest.mark.gpu
def test_dropout_mask_identical_on_cpu_and_cuda():
    x, r = torch.randn(33, 70), torch.randn(33, 70)
    cpu = _dropout_out(x, None, r, 0.3, 4242)
    gpu = _dropout_out(x.cuda(), None, r.cuda(), 0.3, 4242)
    assert torch.equal((cpu - r) == 0, ((gpu - r.cuda()) == 0).cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_pointwise(device):
    x = torch.randn(3, 10, device=device, requires_grad=True)
    b = torch.randn(10, device=device, requires_grad=True)
    r = torch.randn(3, 10, device=device, requires_grad=True)
    seed = torch.tensor([3], device=device)
    ops = torch.ops.slipway
    torch.library.opcheck(ops.bias_gelu, (x, b))
    torch.library.opcheck(ops.bias_gelu_backward, (torch.randn(3, 10, device=device), x.detach(), b.detach()))
    torch.library.opcheck(ops.bias_dropout_add, (x, b, r, 0.2, seed))
    torch.library.opcheck(ops.bias_dropout_add, (x, None, r, 0.0, seed))
    torch.library.opcheck(ops.dropout_backward, (torch.randn(3, 10, device=device), 0.2, seed))
