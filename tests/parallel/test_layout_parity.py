"""Changing the layout must not change the loss (architecture principle 6).

The tiny GPT trains 20 AdamW steps (fp32, dropout off, gradient clipping active) under each (tp, pp, dp)
layout, with and without sequence parallelism, on CPU gloo with the compiled csrc kernels
(kernels=csrc); every layout's losses, gradient norms and eval loss must equal the single-process run's
within 1e-5 relative, and its initial weights and the gradients of every parameter (gathered to full
shape) must match.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.parallel import harness as H

# ~30 s on 2 cores (eight rounds of gloo worlds in the module fixture): not in `make test-fast`.
pytestmark = pytest.mark.slow

# (tp, pp, dp, sequence_parallel)
LAYOUTS = [(2, 1, 1, False), (1, 2, 1, False), (1, 4, 1, False), (2, 2, 1, False), (1, 1, 2, False),
           (2, 1, 2, False), (1, 2, 2, False), (2, 1, 1, True), (2, 2, 1, True), (2, 1, 2, True)]


def _job(ranks, tp, pp, sp, outdir, schedule="1f1b"):
    return (ranks, H.parity_job, (tp, pp, sp, schedule, outdir))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("parity")
    d = str(out)
    rounds = [  # two-rank layouts run side by side on ranks 0-1 and 2-3
        [_job([0, 1], 2, 1, False, d), _job([2, 3], 1, 2, False, d)],
        [_job([0, 1], 1, 1, False, d), _job([2, 3], 2, 1, True, d)],
        [_job([0, 1, 2, 3], 1, 4, False, d)],
        [_job([0, 1, 2, 3], 2, 2, False, d)],
        [_job([0, 1, 2, 3], 2, 1, False, d)],
        [_job([0, 1, 2, 3], 1, 2, False, d)],
        [_job([0, 1, 2, 3], 2, 2, True, d)],
        [_job([0, 1, 2, 3], 2, 1, True, d)],
    ]
    H.run_rounds(4, rounds, out)
    records = {"ref": [H.reference_record()]}
    for path in sorted(Path(out).glob("*.pt")):
        records.setdefault(path.name.split(".")[0], []).append(torch.load(path, weights_only=False))
    return records


EMB, HEAD = "embedding.word_embeddings.weight", "word_embeddings_for_head.weight"


def _params_close(full: dict, ref: dict, what: str, rtol: float, atol: float) -> None:
    """Compare assembled tensors with the reference; the head's copy of the tied embedding included."""
    assert set(full) - {HEAD} == set(ref), f"{what}: parameter sets differ"
    vocab = H.CFG.vocab_size
    for name, t in full.items():
        r = ref[EMB if name == HEAD else name]
        if name in (EMB, HEAD):
            assert t[vocab:].abs().max() == 0, f"{what}: padded vocabulary rows of {name} are not zero"
            t, r = t[:vocab], r[:vocab]
        torch.testing.assert_close(t, r, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{what} {n}: {m}")


@pytest.mark.parametrize("tp,pp,dp,sp", LAYOUTS, ids=[H.layout_tag(*lay) for lay in LAYOUTS])
def test_layout_matches_single_process(runs, tp, pp, dp, sp):
    records, ref = runs[H.layout_tag(tp, pp, dp, sp)], runs["ref"][0]
    assert len(records) == tp * pp * dp
    last = records[[r["coords"][1] for r in records].index(pp - 1)]
    for i, (loss, ref_loss) in enumerate(zip(last["losses"], ref["losses"], strict=True)):
        assert H.rel_diff(loss, ref_loss) < 1e-5, f"step {i}: loss {loss} vs single-process {ref_loss}"
    assert all(r["losses"] == last["losses"] for r in records), "ranks report different losses"
    for i, (norm, ref_norm) in enumerate(zip(last["norms"], ref["norms"], strict=True)):
        assert H.rel_diff(norm, ref_norm) < 1e-5, f"step {i}: grad norm {norm} vs {ref_norm}"
    assert H.rel_diff(last["eval"], ref["eval"]) < 1e-5
    _params_close(H.assemble(records, "init"), ref["init"], "initial weights", 0, 0)
    _params_close(H.assemble(records, "grads0"), ref["grads0"], "step-0 grads", 1e-5, 1e-7)
    _params_close(H.assemble(records, f"grads{H.STEPS - 1}"), ref[f"grads{H.STEPS - 1}"], "last grads",
                  1e-3, 1e-6)


def test_losses_actually_move(runs):
    losses = runs["ref"][0]["losses"]
    assert losses[-1] < losses[0] - 0.1, losses  # parity of a flat curve would prove little
    assert max(runs["ref"][0]["norms"]) > H.MAX_NORM  # clipping was active


def test_dp_reduction_overlaps_backward(runs):
    for tag in ("tp1_pp1_dp2", "tp2_pp1_dp2", "tp1_pp2_dp2"):
        for rec in runs[tag]:
            assert rec["n_buckets"] > 1
            assert min(rec["overlap"]) >= 1, f"{tag}: no bucket all-reduce started inside backward"
