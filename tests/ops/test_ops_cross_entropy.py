"""Fused (vocab-parallel) cross-entropy: local-shard primitives, the autograd function, a real 2-rank run."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.ops.helpers import DEVICES, DTYPES, assert_close, rand
from trainer import extension as _ext
from trainer.ops import reference

pytestmark = pytest.mark.skipif(not _ext.load(),
                                reason="trainer._C not built (tests/ops/test_dispatch.py fails)")
if _ext.load():
    from trainer.ops import cross_entropy as ce
    from trainer.ops import fused  # noqa: F401 - registers the fake kernels opcheck needs (also when run alone)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 11), (2, 5, 257), (3, 1), (4, 4096)])
def test_cross_entropy_matches_reference(device, dtype, shape):
    logits = (rand(shape, torch.float32, device) * 4).to(dtype).requires_grad_()
    target = torch.randint(0, shape[-1], shape[:-1], device=device)
    loss = ce.cross_entropy(logits, target)
    lr = logits.detach().float().requires_grad_()
    ref = reference.cross_entropy(lr, target)
    assert loss.dtype == torch.float32 and loss.shape == target.shape
    assert_close(loss, ref, dtype if dtype != torch.float32 else torch.float32)
    g = torch.rand(target.shape, device=device)
    loss.backward(g)
    ref.backward(g)
    assert logits.grad.dtype == dtype
    assert_close(logits.grad, lr.grad, dtype)


def test_padded_vocab_slice_is_read_in_place_and_inplace_grad():
    """logits[..., :V] of a padded vocab (a strided view) works; inplace_grad overwrites the logits."""
    padded = torch.randn(3, 4, 40)
    view = padded[..., :37]
    target = torch.randint(0, 37, (3, 4))
    torch.testing.assert_close(ce.cross_entropy(view, target), reference.cross_entropy(view, target))
    logits = torch.randn(12, 37, requires_grad=True)
    buf = logits.detach().clone().requires_grad_()
    t = target.flatten()
    ce.cross_entropy(buf, t, inplace_grad=True).sum().backward()
    reference.cross_entropy(logits, t).sum().backward()
    torch.testing.assert_close(buf.grad, logits.grad)
    torch.testing.assert_close(buf.detach(), logits.grad)  # the gradient was written over the logits


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace", [False, True])
def test_vocab_size_leaves_padding_out_without_a_slice(device, dtype, inplace):
    """The head passes the padded logits and the true vocabulary: the loss is the sliced reference's, the
    padded columns get a zero gradient, autograd records no slice (whose backward zero-fills a
    [tokens, V_pad] tensor), and in place the gradient lands in the padded logits' own memory (the kernel
    writes each row at the padded row stride)."""
    padded, vocab = 40, 37
    base = (rand((3, 4, padded), torch.float32, device) * 4).to(dtype)
    target = torch.randint(0, vocab, (3, 4), device=device)
    logits = base.clone().requires_grad_()
    mine = logits * 1.0  # a non-leaf, as the head's matmul output is
    loss = ce.cross_entropy(mine, target, inplace_grad=inplace, vocab_size=vocab)
    assert "Slice" not in str(loss.grad_fn.next_functions)
    ref_in = base.float().requires_grad_()
    ref = reference.cross_entropy(ref_in, target, vocab_size=vocab)
    assert_close(loss, ref, dtype if dtype != torch.float32 else torch.float32)
    g = torch.rand(target.shape, device=device)
    loss.backward(g)
    ref.backward(g)
    assert_close(logits.grad, ref_in.grad, dtype)
    assert torch.count_nonzero(logits.grad[..., vocab:]) == 0
    if inplace:
        assert_close(mine.detach(), ref_in.grad, dtype)  # written over the (padded) logits


def test_inplace_grad_refuses_logits_without_one_row_stride():
    logits = torch.randn(4, 6, 10)[:, :3]  # rows at two strides (10 within a block of 3, 60 between)
    lse, t = torch.zeros(4, 3), torch.zeros(4, 3, dtype=torch.long)
    with pytest.raises(RuntimeError, match="one row stride"):
        torch.ops.slipway.ce_local_grad_(logits, t, 0, lse, torch.ones(4, 3))


def test_sharded_stats_combine_to_full_loss_and_grad():
    """Splitting the vocab into shards and combining (max, sumexp, target logit) gives the full loss."""
    logits, v = torch.randn(9, 50, dtype=torch.float64), 50
    target = torch.randint(0, v, (9,))
    bounds = [(0, 17), (17, 33), (33, 50)]
    stats = [ce.ce_local_stats(logits[:, a:b], target, a, b) for a, b in bounds]
    gmx = torch.stack([s[0] for s in stats]).amax(0)
    se = sum(s[1] * torch.exp(s[0] - gmx) for s in stats)
    lse = gmx + torch.log(se)
    loss = lse - sum(s[2] for s in stats)
    lr = logits.clone().requires_grad_()
    ref = reference.cross_entropy(lr, target)
    torch.testing.assert_close(loss, ref)
    g = torch.rand(9, dtype=torch.float64)
    ref.backward(g)
    grads = [ce.ce_local_grad_(logits[:, a:b].clone(), target, a, b, lse, g) for a, b in bounds]
    torch.testing.assert_close(torch.cat(grads, -1), lr.grad)
    with pytest.raises(ValueError, match="shard"):
        ce.ce_local_stats(logits[:, :17], target, 0, 20)


def test_cross_entropy_gradcheck_double():
    logits = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 9, (4,))
    assert torch.autograd.gradcheck(lambda t: ce.cross_entropy(t, target), (logits,))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_cross_entropy_ops(device):
    ops = torch.ops.slipway
    logits = torch.randn(6, 13, device=device)
    target = torch.randint(0, 26, (6,), device=device)
    torch.library.opcheck(ops.ce_local_stats, (logits, target, 13))
    lse, g = torch.randn(6, device=device), torch.rand(6, device=device)
    torch.library.opcheck(ops.ce_local_grad, (logits, target, 13, lse, g))
    torch.library.opcheck(ops.ce_local_grad_, (logits.clone(), target, 13, lse, g))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_rank_worker(rank: int, port: int, logits: torch.Tensor, target: torch.Tensor, outdir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        half = logits.shape[-1] // 2
        shard = logits[:, rank * half:(rank + 1) * half].clone().requires_grad_()
        loss = ce.cross_entropy(shard, target, vocab_start=rank * half, group=dist.group.WORLD)
        loss.sum().backward()
        torch.save((loss.detach(), shard.grad), os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_cross_entropy_two_gloo_ranks(tmp_path):
    logits = torch.randn(5, 24)
    target = torch.randint(0, 24, (5,))
    mp.spawn(_two_rank_worker, args=(_free_port(), logits, target, str(tmp_path)), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    lr = logits.clone().requires_grad_()
    ref = reference.cross_entropy(lr, target)
    ref.sum().backward()
    for loss, _ in results:
        torch.testing.assert_close(loss, ref.detach())
    torch.testing.assert_close(torch.cat([results[0][1], results[1][1]], -1), lr.grad)
