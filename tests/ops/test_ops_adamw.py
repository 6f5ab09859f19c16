"""Multi-tensor AdamW against torch.optim.AdamW (the math it must match) and the eager reference."""

from __future__ import annotations

import pytest
import torch

from tests.ops.helpers import DEVICES
from trainer import extension as _ext
from trainer.ops import reference

pytestmark = pytest.mark.skipif(not _ext.load(),
                                reason="trainer._C not built (tests/ops/test_dispatch.py fails)")
if _ext.load():
    from trainer.ops.adamw import AdamWHyper, AdamWTensors, FusedAdamW, adamw_step

SHAPES = [(37,), (129, 65), (70000,), (1,)]  # 70000 spans two chunks of the CUDA kernel


def _state(shapes, device):
    zeros = [torch.zeros(s, device=device) for s in shapes]
    return AdamWTensors([torch.randn(s, device=device) for s in shapes], [z.clone() for z in zeros],
                        [z.clone() for z in zeros], [z.clone() for z in zeros])


@pytest.mark.parametrize("device", DEVICES)
def test_adamw_matches_torch_optim_adamw(device):
    """Ten steps, fp32: equal to torch.optim.AdamW within 2e-6 relative (about an ulp per step; torch's
    own vectorised CPU sqrt is not correctly rounded, so bitwise equality is not attainable)."""
    torch.manual_seed(0)
    hp = AdamWHyper(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    mine = _state(SHAPES, device)
    ref = AdamWTensors([p.clone() for p in mine.params], [g.clone() for g in mine.grads],
                       [m.clone() for m in mine.exp_avgs], [v.clone() for v in mine.exp_avg_sqs])
    params = [p.clone().requires_grad_() for p in mine.params]
    opt = torch.optim.AdamW(params, lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps,
                            weight_decay=hp.weight_decay, foreach=False)
    for step in range(1, 11):
        grads = [torch.randn(s, device=device) for s in SHAPES]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        mine.grads, ref.grads = grads, grads
        adamw_step(mine, hp, step)
        reference.adamw_step(ref, hp, step)
    for a, b, c in zip(params, mine.params, ref.params):
        torch.testing.assert_close(b, a.detach(), rtol=2e-6, atol=2e-7)
        torch.testing.assert_close(c, a.detach(), rtol=0, atol=0)  # the reference is torch's op sequence


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16])
def test_adamw_master_weights_write_low_precision_copies(device, model_dtype):
    hp = AdamWHyper(lr=1e-2, weight_decay=0.01, grad_scale=0.5)
    mine = _state([(33, 7), (5,)], device)
    mine.model_params = [p.to(model_dtype) for p in mine.params]
    ref = AdamWTensors([p.clone() for p in mine.params], list(mine.grads), [m.clone() for m in mine.exp_avgs],
                       [v.clone() for v in mine.exp_avg_sqs])
    for step in (1, 2, 3):
        grads = [torch.randn(p.shape, device=device).to(model_dtype) for p in mine.params]
        mine.grads, ref.grads = grads, grads
        adamw_step(mine, hp, step)
        reference.adamw_step(ref, hp, step)
    for master, model, expected in zip(mine.params, mine.model_params, ref.params):
        torch.testing.assert_close(master, expected, rtol=2e-6, atol=2e-7)
        assert torch.equal(model, master.to(model_dtype))


def test_fused_adamw_optimizer_trains_like_torch_adamw():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    twin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    twin.load_state_dict(model.state_dict())
    opt = FusedAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, foreach=False)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    for _ in range(5):
        for m, o in ((model, opt), (twin, ref)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    bf = torch.nn.Linear(4, 4).bfloat16()
    bopt = FusedAdamW(bf.parameters(), lr=1e-2)
    bf(torch.randn(2, 4).bfloat16()).float().sum().backward()
    bopt.step()
    master = bopt.state[bf.weight]["master"]
    assert master.dtype == torch.float32 and torch.equal(bf.weight.detach(), master.bfloat16())


def test_adamw_rejects_bad_state_with_a_clear_error():
    z = torch.zeros(3)
    t = AdamWTensors([z], [z.clone()], [torch.zeros(3, dtype=torch.float64)], [z.clone()])
    with pytest.raises(RuntimeError, match="float32"):
        adamw_step(t, AdamWHyper(lr=1e-3), 1)
    with pytest.raises(ValueError, match="equal length"):
        AdamWTensors([torch.zeros(3)], [], [], [])
    with pytest.raises(ValueError, match="betas"):
        AdamWHyper(lr=1e-3, beta1=1.0)


def test_opcheck_adamw():
    p, g, m, v = (torch.randn(10).abs() for _ in range(4))
    torch.library.opcheck(torch.ops.slipway.adamw_step_,
                          ([p], [g], [m], [v], [], 1e-3, 0.9, 0.999, 1e-8, 0.01, 1, 1.0),
                          test_utils=("test_schema", "test_faketensor"))
