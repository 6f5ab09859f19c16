"""Layout parity with interleaving (architecture principle 6): the 20-step fp32 run of
test_layout_parity under v=2 model chunks per stage at p ∈ {2, 4} (an 8-layer GPT for p=4), combined
with tensor and sequence parallelism and with data parallelism — losses, gradient norms and eval loss
within 1e-5 relative of the single-process run, weights and gradients equal — and every recomputation
setting bit-identical to none with dropout on (test_recompute's check) at pp=2, v=2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.parallel import harness as H
from tests.parallel import test_recompute as R
from trainer.parallel import ParallelConfig, ParallelState

pytestmark = pytest.mark.slow  # ~15 s on 2 cores (four rounds of gloo worlds)

# (tp, pp, dp, sequence_parallel, vp, num_layers, schedule)
LAYOUTS = [(1, 2, 1, False, 2, 4, "1f1b"), (1, 2, 1, False, 2, 4, "afab"), (1, 4, 1, False, 2, 8, "1f1b"),
           (2, 2, 1, True, 2, 4, "1f1b"), (1, 2, 2, False, 2, 4, "1f1b")]


def _tag(tp, pp, dp, sp, vp, layers, schedule):
    return H.layout_tag(tp, pp, dp, sp, vp, layers) + ("_afab" if schedule == "afab" else "")


def _job(ranks, tp, pp, sp, vp, layers, schedule, outdir):
    return (ranks, _parity_job, (tp, pp, sp, vp, layers, schedule, outdir))


def _parity_job(ranks, tp, pp, sp, vp, layers, schedule, outdir):
    sub = Path(outdir, schedule)
    sub.mkdir(exist_ok=True)
    H.parity_job(ranks, tp, pp, sp, schedule, str(sub), vp, layers)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("parity_vpp")
    d = str(out)
    H.run_rounds(4, [[_job([0, 1], 1, 2, False, 2, 4, "1f1b", d), _job([2, 3], 1, 2, False, 2, 4, "afab", d)],
                     [_job([0, 1, 2, 3], 1, 4, False, 2, 8, "1f1b", d)],
                     [_job([0, 1, 2, 3], 2, 2, True, 2, 4, "1f1b", d)],
                     [_job([0, 1, 2, 3], 1, 2, False, 2, 4, "1f1b", d)],
                     [([0, 1], _recompute_job, (d,))]], out)
    records = {"ref4": [H.reference_record(4)], "ref8": [H.reference_record(8)]}
    records["recompute"] = [torch.load(p) for p in sorted(Path(out).glob("recompute.*.pt"))]
    for path in sorted(Path(out).glob("*/*.pt")):
        tag = path.name.split(".")[0] + ("_afab" if path.parent.name == "afab" else "")
        records.setdefault(tag, []).append(torch.load(path, weights_only=False))
    return records


@pytest.mark.parametrize("layout", LAYOUTS, ids=[_tag(*lay) for lay in LAYOUTS])
def test_interleaved_layout_matches_single_process(runs, layout):
    tp, pp, dp, _, _, layers, _ = layout
    worst = H.assert_parity(runs[_tag(*layout)], runs[f"ref{layers}"][0], tp * pp * dp, pp)
    print(f"{_tag(*layout)}: max rel. difference of losses and grad norms {worst:.2e}")


def _recompute_job(ranks, outdir):
    """Dropout on, each recompute setting against none at pp=2, v=2 (test_recompute's check)."""
    pstate = ParallelState.build(1, 2, ranks)
    pcfg = ParallelConfig(pp_size=2, virtual_pp_size=2, bucket_size_mb=0.01)
    ref = R._record(pstate, pcfg, R.Recompute())
    torch.save([R._same(ref, R._record(pstate, pcfg, s)) for s in R.SETTINGS],
               Path(outdir, f"recompute.{H.position(ranks)}.pt"))
    pstate.destroy()


def test_recompute_is_bit_identical_with_chunks(runs):
    assert runs["recompute"] == [[True] * len(R.SETTINGS)] * 2


def test_dp_reduction_overlaps_backward_with_chunks(runs):
    for rec in runs[_tag(1, 2, 2, False, 2, 4, "1f1b")]:
        assert rec["n_buckets"] > 1
        assert min(rec["overlap"]) >= 1, "no bucket all-reduce started inside backward"
