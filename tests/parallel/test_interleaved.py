"""The interleaved 1F1B schedule (parallel.virtual_pp_size > 1): Megatron's layer assignment and chunk
order, refusals with fixes, and on real gloo groups gradients equal to the all-forward-all-backward
order over the same chunks and to the single-process model, with at most Megatron's warm-up count of
micro-batches in flight (1F1B's memory bound, not AFAB's m·v) — on the first stage the
``memory_formulas.interleaved_memory_factor`` × 1F1B's activations."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from tests.parallel import harness as H
from trainer.formulas import PipelineSplit
from trainer.memory_formulas import interleaved_memory_factor
from trainer.parallel import ParallelConfig, ParallelState, build_model, finish_grad_sync, sharding
from trainer.parallel import engine as E
from trainer.parallel.apply import check_compatible, stage_spec
from trainer.parallel.interleaved import (
    INTERLEAVED_SCHEDULES,
    check_microbatches,
    chunk_id,
    num_warmup,
)


def test_megatron_layer_assignment():
    # 8 layers, p=2, v=2: rank 0 holds [0,1] and [4,5], rank 1 [2,3] and [6,7] (chunk c·p + r).
    held = {(r, c): list(sharding.stage_layers(8, 2, r, 2, c)) for r in range(2) for c in range(2)}
    assert held == {(0, 0): [0, 1], (0, 1): [4, 5], (1, 0): [2, 3], (1, 1): [6, 7]}
    for L, p, v in [(8, 2, 2), (12, 2, 3), (16, 4, 2), (12, 3, 1)]:
        for i in range(L):
            r, c, local = sharding.chunk_of_layer(i, L, p, v)
            assert sharding.stage_layers(L, p, r, v, c)[local] == i
    specs = {(r, c): stage_spec(PipelineSplit(8, 2, 2), r, c) for r in range(2) for c in range(2)}
    assert [k for k, s in specs.items() if s.pre_process] == [(0, 0)]
    assert [k for k, s in specs.items() if s.post_process] == [(1, 1)]


def test_chunk_order_and_warmup_follow_megatron():
    assert [chunk_id(k, 2, 2, True) for k in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [chunk_id(k, 2, 2, False) for k in range(8)] == [1, 1, 0, 0, 1, 1, 0, 0]
    # (p − r − 1)·2 + (v − 1)·p, capped at m·v; all forwards first when m = p
    assert [num_warmup(4, r, 2, 8) for r in range(4)] == [10, 8, 6, 4]
    assert num_warmup(2, 0, 3, 2) == 6 and num_warmup(4, 0, 3, 8) == 14


def test_refusals_say_how_to_fix():
    cfg = dataclasses.replace(H.CFG, num_layers=6)
    with pytest.raises(ValueError, match="vpp_layers.*pp_size·virtual_pp_size = 2·2 = 4.*virtual_pp_size=3"):
        check_compatible(cfg, ParallelConfig(pp_size=2, virtual_pp_size=2))
    with pytest.raises(ValueError, match="virtual_pp.*parallel.virtual_pp_size=1, or parallel.pp_size>=2"):
        ParallelConfig(virtual_pp_size=2)  # the section refuses itself (Megatron: pp > 1)
    with pytest.raises(ValueError, match=r"micro-batches per step \(6\).*pp_size=4"):
        check_microbatches(6, 4)


class _CountingRunner(E._Runner):
    """The engine's runner, recording how many micro-batches are in flight at most."""

    def __init__(self, model, batches):
        super().__init__(model, batches)
        self.alive = self.peak = 0

    def forward(self, x, chunk=0):
        self.alive += 1
        self.peak = max(self.peak, self.alive)
        return super().forward(x, chunk)

    def backward(self, x, y, dy, chunk=0):
        self.alive -= 1
        return super().backward(x, y, dy, chunk)


def _batches(m: int) -> list[dict[str, torch.Tensor]]:
    batch, b = H.global_batch(0), H.GLOBAL_BATCH // m
    return [{k: t[j * b:(j + 1) * b] for k, t in batch.items()} for j in range(m)]


def grads_job(ranks: list[int], v: int, m: int, outdir: str) -> None:
    """One step with each interleaved schedule; this rank's gradients and peak in-flight count."""
    p = len(ranks)
    pstate = ParallelState.build(1, p, ranks)
    cfg = dataclasses.replace(H.CFG, num_layers=p * v)
    out = {}
    for schedule in ("1f1b", "afab"):
        model = build_model(cfg, ParallelConfig(pp_size=p, virtual_pp_size=v), pstate, H.SEED)
        runner = _CountingRunner(model, _batches(m))
        model.grads.zero()  # as train_step: .grad are the bucket views finish_grad_sync reduces
        INTERLEAVED_SCHEDULES[schedule](runner, E._p2p(model, runner.batches), m, v)
        finish_grad_sync(model)
        out[schedule] = {"grads": {n: q.grad.clone() for n, q in model.named_parameters()},
                         "peak": runner.peak, "losses": [x.item() for x in runner.losses]}
    torch.save(out, os.path.join(outdir, f"p{p}_v{v}_m{m}.{pstate.pp_rank}.pt"))
    pstate.destroy()


CASES = [(2, 2, 4), (2, 3, 6), (2, 2, 2), (4, 2, 8)]  # (p, v, m): steady state, capped warm-up, m = p


@pytest.fixture(scope="module")
def grads(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("interleaved")
    d = str(out)
    H.run_rounds(4, [[([0, 1], grads_job, (2, 4, d)), ([2, 3], grads_job, (3, 6, d))],
                     [([0, 1], grads_job, (2, 2, d)), ([2, 3], grads_job, (2, 4, d))],
                     [([0, 1, 2, 3], grads_job, (2, 8, d))]], out)
    return out


def _reference(num_layers: int, m: int) -> dict[str, torch.Tensor]:
    cfg = dataclasses.replace(H.CFG, num_layers=num_layers)
    single = build_model(cfg, ParallelConfig(), ParallelState.single(), H.SEED)
    E.train_step(single, _batches(m))
    return {single.global_name(n): q.grad for n, q in single.named_parameters()}


@pytest.mark.parametrize("p,v,m", CASES, ids=[f"p{p}_v{v}_m{m}" for p, v, m in CASES])
def test_gradients_match_afab_and_single_process(grads, p, v, m):
    ref = _reference(p * v, m)
    seen = set()
    for r in range(p):
        rec = torch.load(grads / f"p{p}_v{v}_m{m}.{r}.pt")
        one, afab = rec["1f1b"], rec["afab"]
        assert one["grads"].keys() == afab["grads"].keys()
        for name, g in one["grads"].items():
            torch.testing.assert_close(g, afab["grads"][name], rtol=1e-6, atol=1e-9, msg=name)
            full = ref[H.EMB if name == H.HEAD else name]
            torch.testing.assert_close(g, full, rtol=1e-5, atol=1e-7, msg=name)
            seen.add(name)
        # Megatron's bound: warm-up forwards plus the steady state's one; AFAB keeps all m·v.
        bound = num_warmup(p, r, v, m) + (num_warmup(p, r, v, m) < m * v)
        assert one["peak"] == min(bound, m * v), (r, one["peak"])
        assert afab["peak"] == m * v
        if r == 0 and m > p:  # the first stage's activations vs 1F1B's p micro-batches of a whole stage
            assert one["peak"] / v / p == pytest.approx(interleaved_memory_factor(p, v))
        if r == p - 1:
            assert len(one["losses"]) == m and one["losses"] == afab["losses"]
    assert seen - {H.HEAD} == set(ref)  # every layer of the model is held by exactly one chunk


def test_chunked_model_names_are_global_and_module_is_refused():
    from trainer.model.gpt import GPT
    from trainer.parallel.random import seed_everything

    ps, cfg = ParallelState.single(), dataclasses.replace(H.CFG, num_layers=8)
    # rank 1: layers 2,3 and 6,7
    chunks = [GPT(cfg, stage_spec(PipelineSplit(8, 2, 2), 1, c)) for c in range(2)]
    model = E.ParallelModel(chunks, ps, ParallelConfig(pp_size=2, virtual_pp_size=2), seed_everything(0, ps))
    layers = sorted({int(n.split(".")[2]) for n, _ in model.named_parameters() if ".layers." in n})
    assert layers == [2, 3, 6, 7] and set(model.partition_dims) == {n for n, _ in model.named_parameters()}
    name = "encoder.layers.6.mlp.dense_4h_to_h.bias"
    assert model.global_name(name) == name  # already global: not renumbered again
    with pytest.raises(AttributeError, match="use ParallelModel.chunks"):
        model.module  # noqa: B018
