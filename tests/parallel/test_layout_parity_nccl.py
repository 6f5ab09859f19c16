"""Layout parity on NCCL (architecture principle 6 on GPUs): the layouts of test_layout_parity.py, each
rank on its own GPU, against the single-process run on one GPU, through the same harness and the same
bounds. A layout needs tp·pp·dp GPUs (``min_gpus``): on a 2-GPU machine the tp=2, pp=2, dp=2 layouts
run, on 4 all of them (tp=2 × dp=2 among them). Rehearsed on CPU gloo with SLIPWAY_GPU_REHEARSAL=1
(tests/accel.py), where it trains the gloo test's layouts through this file's spawned workers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import accel as A
from tests.parallel import harness as H


def _world(layout: tuple[int, int, int, bool]) -> int:
    tp, pp, dp, _ = layout
    return tp * pp * dp


@pytest.fixture(scope="module")
def runs(accel, tmp_path_factory) -> dict[str, list[dict]]:
    """Every layout that fits on the devices present, each in its own world of exactly its ranks."""
    out = tmp_path_factory.mktemp("parity-nccl")
    for layout in (lay for lay in H.LAYOUTS if _world(lay) <= A.device_count()):
        tp, pp, _, sp = layout
        world = _world(layout)
        job = (list(range(world)), H.parity_job, (tp, pp, sp, "1f1b", str(out)))
        H.run_rounds(world, [[job]], out, backend=accel.backend, start_method="spawn")
    records = {"ref": [H.reference_record(device=accel.device)]}
    for path in sorted(Path(out).glob("*.pt")):
        records.setdefault(path.name.split(".")[0], []).append(torch.load(path, weights_only=False))
    return records


PARAMS = [pytest.param(*lay, marks=A.min_gpus(_world(lay)), id=H.layout_tag(*lay)) for lay in H.LAYOUTS]


@pytest.mark.parametrize("tp,pp,dp,sp", PARAMS)
def test_nccl_layout_matches_single_gpu(accel, runs, tp, pp, dp, sp):
    records = runs[H.layout_tag(tp, pp, dp, sp)]
    assert {(r["device"], r["backend"]) for r in records} == {(accel.device, accel.backend)}
    H.assert_parity(records, runs["ref"][0], tp * pp * dp, pp)
