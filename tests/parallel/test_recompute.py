"""Activation recomputation does not change the math: with dropout on, losses and gradients are
bit-identical to no recomputation, single-device and under tensor (with sequence) and pipeline
parallelism — recomputed dropout draws the first forward's masks, from the default generators and from
the model-parallel tracker's forked state alike."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tests.parallel import harness as H
from trainer.model.recompute import Recompute
from trainer.parallel import ParallelConfig, ParallelState, build_model, train_step

CFG = dataclasses.replace(H.CFG, hidden_dropout=0.1, attention_dropout=0.1, attention_backend="softmax")
SETTINGS = [Recompute("selective"), Recompute("full", "uniform", 1), Recompute("full", "uniform", 2),
            Recompute("full", "block", 1)]
STEPS = 3


def _record(pstate: ParallelState, pcfg: ParallelConfig, recompute: Recompute) -> dict:
    model = build_model(CFG, pcfg, pstate, H.SEED, kernels=H.KERNELS, recompute=recompute)
    out = {"losses": [], "grads": []}
    state: dict = {}
    for step in range(STEPS):
        out["losses"].append(train_step(model, H.microbatches(step, pstate.dp_rank, pstate.dp_size)))
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        H.adamw_step(model.parameters(), state, step)
    return out


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"], strict=True)) and all(
        ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga)
        for ga, gb in zip(a["grads"], b["grads"], strict=True))


def recompute_job(ranks: list[int], tp: int, pp: int, sp: bool, outdir: str) -> None:
    pstate = ParallelState.build(tp, pp, ranks)
    pcfg = ParallelConfig(tp_size=tp, pp_size=pp, sequence_parallel=sp, bucket_size_mb=0.01)
    ref = _record(pstate, pcfg, Recompute())
    same = [_same(ref, _record(pstate, pcfg, s)) for s in SETTINGS]
    torch.save(same, os.path.join(outdir, f"{H.layout_tag(tp, pp, 1, sp)}.{H.position(ranks)}.pt"))
    pstate.destroy()


LAYOUTS = [(2, 1, True), (1, 2, False), (2, 2, False)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("recompute")
    rounds = [[([0, 1], recompute_job, (2, 1, True, str(out))),
               ([2, 3], recompute_job, (1, 2, False, str(out)))],
              [([0, 1, 2, 3], recompute_job, (2, 2, False, str(out)))]]
    H.run_rounds(4, rounds, out)
    return out


def test_single_device_recompute_is_bit_identical():
    ref = _record(ParallelState.single(), ParallelConfig(), Recompute())
    assert [_same(ref, _record(ParallelState.single(), ParallelConfig(), s)) for s in SETTINGS] == [True] * 4
    assert len({float(x) for x in ref["losses"]}) == STEPS  # the losses move: a real comparison


@pytest.mark.parametrize("tp,pp,sp", LAYOUTS)
def test_recompute_is_bit_identical_at_every_layout(results, tp, pp, sp):
    files = sorted(results.glob(f"{H.layout_tag(tp, pp, 1, sp)}.*.pt"))
    assert len(files) == tp * pp
    for f in files:
        assert torch.load(f) == [True] * len(SETTINGS), (f.name, SETTINGS)


def test_groups_follow_megatrons_methods():
    assert Recompute("full", "uniform", 2).groups(5) == [(0, 2, True), (2, 4, True), (4, 5, True)]
    assert Recompute("full", "block", 2).groups(5) == [(0, 1, True), (1, 2, True), (2, 5, False)]
    assert Recompute("selective").groups(3) == Recompute().groups(3) == [(0, 3, False)]
