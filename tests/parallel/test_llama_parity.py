"""Changing the layout must not change the loss of the Llama-style GPT either (issue 16).

The same 20-step fp32 AdamW run as tests/parallel/test_layout_parity.py, on ``harness.LLAMA_CFG``:
grouped-query attention with fewer KV groups than heads (tp=2 holds one group and its two query heads per
rank), rope, RMSNorm, SwiGLU (the gate/up halves each rank holds), no biases and an untied, vocab-parallel
head. Losses, gradient norms and the eval loss must match the single-process run within 1e-5 relative,
the initial weights exactly and the gradients of every parameter (assembled by the sharding table's
merge, GLU included) closely.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.parallel import harness as H

OUTPUT = "output_layer.weight"

# ~15 s on 2 cores (four rounds of gloo worlds): not in `make test-fast`.
pytestmark = pytest.mark.slow

# (tp, pp, dp, sequence_parallel)
LAYOUTS = [(2, 1, 1, False), (1, 2, 1, False), (2, 2, 1, False), (1, 1, 2, False), (2, 1, 1, True),
           (2, 2, 1, True), (2, 1, 2, True)]


def _job(ranks, tp, pp, sp, outdir):
    return (ranks, H.parity_job, (tp, pp, sp, "1f1b", outdir, 1, None, "llama"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("llama_parity")
    d = str(out)
    rounds = [  # two-rank layouts side by side on ranks 0-1 and 2-3
        [_job([0, 1], 2, 1, False, d), _job([2, 3], 1, 2, False, d)],
        [_job([0, 1], 1, 1, False, d), _job([2, 3], 2, 1, True, d)],
        [_job([0, 1, 2, 3], 2, 2, False, d)],
        [_job([0, 1, 2, 3], 2, 2, True, d)],
        [_job([0, 1, 2, 3], 2, 1, True, d)],
    ]
    H.run_rounds(4, rounds, out)
    records = {"ref": [H.reference_record(model="llama")]}
    for path in sorted(Path(out).glob("*.pt")):
        records.setdefault(path.name.split(".")[0], []).append(torch.load(path, weights_only=False))
    return records


def _params_close(full: dict, ref: dict, what: str, rtol: float, atol: float) -> None:
    """As the GPT parity test, with the untied head's padded vocabulary rows (TP-dependent) cut too."""
    vocab = H.LLAMA_CFG.vocab_size
    assert not full[OUTPUT][vocab:].any(), f"{what}: padded vocabulary rows of the output layer are not zero"
    torch.testing.assert_close(full[OUTPUT][:vocab], ref[OUTPUT][:vocab], rtol=rtol, atol=atol)
    H.params_close({k: v for k, v in full.items() if k != OUTPUT},
                       {k: v for k, v in ref.items() if k != OUTPUT}, what, rtol, atol)


@pytest.mark.parametrize("tp,pp,dp,sp", LAYOUTS, ids=[H.layout_tag(*lay) for lay in LAYOUTS])
def test_llama_layout_matches_single_process(runs, tp, pp, dp, sp):
    records, ref = runs[H.layout_tag(tp, pp, dp, sp)], runs["ref"][0]
    assert len(records) == tp * pp * dp
    last = records[[r["coords"][1] for r in records].index(pp - 1)]
    worst = max(H.rel_diff(a, b) for a, b in zip(last["losses"], ref["losses"], strict=True))
    assert worst < 1e-5, f"losses differ by up to {worst:.3g} relative: {last['losses']} vs {ref['losses']}"
    assert all(r["losses"] == last["losses"] for r in records), "ranks report different losses"
    for i, (norm, ref_norm) in enumerate(zip(last["norms"], ref["norms"], strict=True)):
        assert H.rel_diff(norm, ref_norm) < 1e-5, f"step {i}: grad norm {norm} vs {ref_norm}"
    assert H.rel_diff(last["eval"], ref["eval"]) < 1e-5
    assert "output_layer.weight" in ref["init"] and "embedding.position_embeddings.weight" not in ref["init"]
    _params_close(H.assemble(records, "init"), ref["init"], "initial weights", 0, 0)
    _params_close(H.assemble(records, "grads0"), ref["grads0"], "step-0 grads", 1e-5, 1e-7)
    # After 20 AdamW steps fp32 reassociation noise reaches ~5e-6 in the untied head's gradient, whose
    # entries go up to ~0.2 (2.5e-5 of its scale): atol 1e-5 here, 1e-6 in the tied GPT's test.
    _params_close(H.assemble(records, f"grads{H.STEPS - 1}"), ref[f"grads{H.STEPS - 1}"], "last grads",
                  1e-3, 1e-5)


def test_llama_losses_actually_move(runs):
    losses = runs["ref"][0]["losses"]
    assert losses[-1] < losses[0] - 0.1, losses
    assert max(runs["ref"][0]["norms"]) > H.MAX_NORM  # clipping was active
