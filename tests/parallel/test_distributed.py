"""Pieces of the parallel machinery on real gloo groups: vocab-parallel CE, dropout RNG, schedules,
the rank grid, and torch.distributed initialisation from torchrun/Slurm environment variables."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.parallel import harness as H
from trainer.parallel import ParallelConfig, ParallelState, build_model, comm, init_distributed, train_step
from trainer.parallel.tensor_parallel import vocab_parallel_cross_entropy


def _save(outdir: str, name: str, obj) -> None:
    torch.save(obj, os.path.join(outdir, f"{name}.{dist.get_rank()}.pt"))


def ce_job(ranks, outdir):
    """tp=2: CE on vocab shards vs F.cross_entropy on the gathered logits, forward and backward."""
    ps = ParallelState.build(2, 1, ranks)
    out = {}
    # (vocab, padded): all of rank 1's columns are padding; padding inside rank 1's range; no padding.
    for vocab, padded, mask in [(100, 256, True), (300, 512, True), (256, 256, True), (300, 512, False)]:
        g = torch.Generator().manual_seed(vocab)
        full = torch.randn(3, 5, padded, generator=g) * 3
        target = torch.randint(0, vocab, (3, 5), generator=g)
        weight = torch.rand(3, 5, generator=g)
        shard = comm.split_dim(full, ps.tp_group, -1).requires_grad_()
        loss = vocab_parallel_cross_entropy(shard, target, ps.tp_group, ps.tp_rank * padded // 2,
                                            vocab if mask else None)
        (loss * weight).sum().backward()
        ref_logits = full.clone().requires_grad_()
        logits = ref_logits[..., :vocab] if mask else ref_logits
        ref = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").view(3, 5)
        (ref * weight).sum().backward()
        grad = comm.all_gather_dim0(shard.grad.movedim(-1, 0).contiguous(), ps.tp_group).movedim(0, -1)
        out[(vocab, padded, mask)] = (loss.detach(), ref.detach(), grad, ref_logits.grad)
    _save(outdir, "ce", out)
    ps.destroy()


def dropout_job(ranks, outdir):
    """tp=2 with dropout on: the replicated residual stream stays identical across TP ranks."""
    ps = ParallelState.build(2, 1, ranks)
    cfg = dataclasses.replace(H.CFG, hidden_dropout=0.2, attention_dropout=0.2)
    model = build_model(cfg, ParallelConfig(tp_size=2), ps, H.SEED)
    tokens = H.microbatches(0, 0, 1)[0]["tokens"]
    module = model.module.train()
    x = module.embedding(tokens)
    for layer in module.encoder.layers:
        x = layer(x)
    with torch.no_grad():
        module.eval()
        y = module.encoder.layers[0](module.embedding(tokens))
    default = torch.rand(16)
    with model.tracker.fork():
        forked = torch.rand(16)
    gathered = [comm.all_gather_dim0(t.detach().unsqueeze(0), ps.tp_group) for t in (x, default, forked)]
    _save(outdir, "dropout", {"hidden": gathered[0], "default": gathered[1], "forked": gathered[2],
                              "eval_changes": not torch.allclose(x, y)})
    ps.destroy()


def schedule_job(ranks, pp, outdir):
    """1F1B and AFAB on the same model and micro-batches (dropout on): identical losses and grads."""
    ps = ParallelState.build(1, pp, ranks)
    cfg = dataclasses.replace(H.CFG, hidden_dropout=0.1, attention_dropout=0.1)
    pcfg = ParallelConfig(pp_size=pp)
    out = {}
    for m in (1, pp, 2 * pp + 1):
        batches = [H.microbatches(k, 0, 1)[0] for k in range(m)]
        results = {}
        for schedule in ("1f1b", "afab"):
            model = build_model(cfg, dataclasses.replace(pcfg, schedule=schedule), ps, H.SEED)
            loss = train_step(model, batches)
            results[schedule] = (loss, {n: p.grad.clone() for n, p in model.named_parameters()})
        out[m] = results
    _save(outdir, f"schedule_pp{pp}", out)
    ps.destroy()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("dist")
    d = str(out)
    H.run_rounds(4, [
        [([0, 1], ce_job, (d,)), ([2, 3], dropout_job, (d,))],
        [([0, 1], schedule_job, (2, d))],  # one world per round: a rank set forms one group per world
        [([0, 1, 2, 3], schedule_job, (4, d))],
    ], out)
    res: dict = {}
    for path in Path(out).glob("*.pt"):
        name, rank, _ = path.name.split(".")
        res.setdefault(name, {})[int(rank)] = torch.load(path, weights_only=False)
    return res


def test_vocab_parallel_cross_entropy_equals_gathered(results):
    for rank, cases in results["ce"].items():
        for case, (loss, ref, grad, ref_grad) in cases.items():
            torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6, msg=f"rank {rank} {case} loss")
            torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-7, msg=f"rank {rank} {case} grad")
            if case[2] and case[0] < case[1]:
                assert grad[..., case[0]:].abs().max() == 0  # padded columns get no gradient


def test_dropout_replicated_where_replicated_sharded_where_sharded(results):
    for rec in results["dropout"].values():
        hidden, default, forked = rec["hidden"], rec["default"], rec["forked"]
        assert torch.equal(hidden[0], hidden[1]), "residual stream diverged across TP ranks"
        assert torch.equal(default[0], default[1]), "default RNG differs across TP ranks"
        assert not torch.equal(forked[0], forked[1]), "model-parallel RNG is the same on both TP ranks"
        assert rec["eval_changes"], "dropout had no effect in training mode"


@pytest.mark.parametrize("pp", [2, 4])
def test_1f1b_equals_afab(results, pp):
    recs = results[f"schedule_pp{pp}"]
    assert len(recs) == pp
    for rank, by_m in recs.items():
        assert sorted(by_m) == [1, pp, 2 * pp + 1]
        for m, res in by_m.items():
            (loss_a, grads_a), (loss_b, grads_b) = res["1f1b"], res["afab"]
            assert torch.equal(loss_a, loss_b), f"rank {rank} m={m}: loss {loss_a} vs {loss_b}"
            for name in grads_a:
                assert torch.equal(grads_a[name], grads_b[name]), f"rank {rank} m={m}: grad of {name}"


def _env_worker(rank: int, world: int, port: int, style: str, outdir: str) -> None:
    env = {"torchrun_env": {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
           "slurm_env": {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world), "SLURM_LOCALID": str(rank),
                     "SLURM_JOB_NODELIST": "localhost", "MASTER_PORT": str(port)}}[style]
    ps = init_distributed(ParallelConfig(tp_size=2), environ=env, timeout_s=60)
    x = comm.all_reduce(torch.ones(1) * (rank + 1), ps.tp_group)
    torch.save((ps.tp_size, ps.dp_size, ps.tp_rank, x.item()), os.path.join(outdir, f"{style}.{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("style", ["torchrun_env", "slurm_env"])  # not "slurm": that is a marker
def test_init_distributed_from_launcher_env(tmp_path, style):
    torch.multiprocessing.start_processes(_env_worker, args=(2, H.free_port(), style, str(tmp_path)),
                                          nprocs=2, start_method="fork")
    got = sorted(torch.load(tmp_path / f"{style}.{r}.pt") for r in range(2))
    assert got == [(2, 1, 0, 3.0), (2, 1, 1, 3.0)]
