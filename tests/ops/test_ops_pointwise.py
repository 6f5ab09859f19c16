"""bias+GeLU and bias+dropout+residual: csrc ops against the eager reference, gradcheck, opcheck."""

from __future__ import annotations

import numpy as np
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
    assert_close(b.grad, br.grad, dtype, scale=PARAM_GRAD_SCALE)  # a sum over rows of rounded terms


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
    """Far into both tails the value and the gradient are the eager reference's (autograd in float64),
    not merely finite: 0 below, x and 1 above."""
    x = torch.tensor([[-200.0, -20.0, -5.0, -1.0, 0.0, 1.0, 5.0, 20.0, 200.0]])
    zeros = torch.zeros(x.shape[-1])
    y = fused.bias_gelu(x, zeros)
    torch.testing.assert_close(y, reference.bias_gelu(x, zeros), atol=1e-6, rtol=1e-6)
    x64 = x.double().requires_grad_()
    reference.bias_gelu(x64, zeros.double()).sum().backward()
    want = x64.grad
    assert want[0, 0] == 0.0 and want[0, -1] == 1.0 and want[0, 4] == 0.5  # the tails and GeLU'(0)
    gx = torch.ops.slipway.bias_gelu_backward(torch.ones_like(x), x, zeros)
    torch.testing.assert_close(gx, want.float(), atol=1e-6, rtol=1e-6)
    gx64 = torch.ops.slipway.bias_gelu_backward(torch.ones_like(x64), x64.detach(), zeros.double())
    torch.testing.assert_close(gx64, want, atol=1e-12, rtol=1e-12)


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


_M32 = 0xFFFFFFFF


def _mix32(x: np.ndarray) -> np.ndarray:
    """lowbias32 on uint64 arrays holding 32-bit values (products fit in 64 bits; & keeps the low 32)."""
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x7FEB352D)) & np.uint64(_M32)
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0x846CA68B)) & np.uint64(_M32)
    return x ^ (x >> np.uint64(16))


def _reference_keep(seed: int, shape: tuple[int, ...], p: float) -> torch.Tensor:
    """The keep mask, written again here from the scheme csrc/slipway_rng.h documents (not read off the
    op): 32 bits per element from lowbias32 of (seed, flat index); dropped when below p·2^32."""
    idx = np.arange(int(np.prod(shape)), dtype=np.uint64)
    s = np.uint64(seed % 2**64)
    lo, hi = idx & np.uint64(_M32), idx >> np.uint64(32)
    h = _mix32(lo ^ (s & np.uint64(_M32)))
    bits = _mix32(h ^ (s >> np.uint64(32)) ^ ((hi * np.uint64(0x9E3779B9)) & np.uint64(_M32)))
    threshold = _M32 if p * 2.0**32 >= _M32 else int(p * 2.0**32)
    return torch.from_numpy(bits >= np.uint64(threshold)).reshape(shape)


def test_reference_keep_mask_is_a_fair_independent_draw():
    """The reference scheme itself: P(drop) = p, different seeds give unrelated masks, rows don't repeat."""
    shape = (8, 31, 64)
    for p in (0.1, 0.25, 0.5):
        frac = 1 - _reference_keep(12345, shape, p).float().mean().item()
        assert abs(frac - p) < 0.02, (p, frac)
    a, b = _reference_keep(1, shape, 0.5), _reference_keep(2, shape, 0.5)
    assert abs((a == b).float().mean().item() - 0.5) < 0.03
    rows = _reference_keep(7, (64, 128), 0.5)
    assert len({tuple(r.tolist()) for r in rows}) == 64


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_dropout_add_training_mask_and_grads(device, dtype):
    p, shape = 0.25, (8, 31, 64)
    x = rand(shape, dtype, device, requires_grad=True)
    b = rand((64,), dtype, device, requires_grad=True)
    r = rand(shape, dtype, device, requires_grad=True)
    seed = torch.tensor([12345], device=device)
    out = torch.ops.slipway.bias_dropout_add(x, b, r, p, seed)
    # The expected mask comes from the documented generator scheme, independently of the op ...
    scale = torch.tensor(1 / (1 - p), dtype=torch.float32)
    mask = _reference_keep(12345, shape, p).float().to(device) * scale.to(device)
    # ... and the op applied to ones shows exactly that mask: 0 where dropped, fp32(1/(1-p)) where kept.
    ones, zeros = torch.ones(shape, device=device), torch.zeros(shape, device=device)
    assert torch.equal(torch.ops.slipway.bias_dropout_add(ones, None, zeros, p, seed), mask)
    expected = r.detach().float() + (x.detach().float() + b.detach().float()) * mask
    assert_close(out, expected, dtype)
    g = rand(shape, dtype, device)
    out.backward(g)
    assert_close(x.grad, g.float() * mask, dtype)
    assert_close(r.grad, g.float(), dtype)
    assert_close(b.grad, (g.float() * mask).sum((0, 1)), dtype, scale=PARAM_GRAD_SCALE)


@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.bfloat16])
def test_bias_dropout_add_output_dtype_is_x_and_residual(residual_dtype):
    """bf16 branch output + fp32 bias: the output is in the promoted dtype of x and the residual, never
    promoted by the bias (autocast with fp32 parameters keeps a bf16 residual stream bf16); fp32 math."""
    x = torch.randn(5, 16).bfloat16().requires_grad_()
    b = torch.randn(16, requires_grad=True)
    r = torch.randn(5, 16).to(residual_dtype).requires_grad_()
    out = fused.bias_dropout_add(x, b, r, 0.0, training=True)
    ref = reference.bias_dropout_add(x, b, r, 0.0, True)
    assert out.dtype == ref.dtype == residual_dtype
    assert_close(out, ref.float(), residual_dtype)
    assert_close(out, (r.double() + x.double() + b.double()).float(), residual_dtype)  # fp32 math
    out.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and b.grad.dtype == torch.float32 and r.grad.dtype == residual_dtype


def _seeds_after(manual_seed: int, n: int) -> list[int]:
    """The seeds fused.bias_dropout_add draws in its next ``n`` calls after torch.manual_seed(manual_seed)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(manual_seed)
        return [int(torch.randint(0, 2**62, (1,), dtype=torch.int64)) for _ in range(n)]


def test_dropout_rng_comes_from_torch_generator():
    """The seed is drawn from torch's default generator: torch.manual_seed (and the RNG tracker, which forks
    that state) reproduces the mask; a different state changes it. Each call's output is the reference
    scheme's mask for the seed torch's generator gives in that position (one int64 in [0, 2^62))."""
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
    (s1, s2), (s4,) = _seeds_after(7, 2), _seeds_after(8, 1)
    for got, seed in ((a1, s1), (a2, s2), (a4, s4)):
        want = r + (x + b) * _reference_keep(seed, x.shape, 0.5).float() * 2.0
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


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
