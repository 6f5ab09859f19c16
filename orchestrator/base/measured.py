"""The MFU figures measured on real GPUs (bench/), as the plan's ETA uses them.

:func:`measured_figures` is the one reader on the orchestrator's side, over the committed machine-readable
figures (bench/results/mfu.json, written by bench/record_mfu.py from a bench/gpu_check.sh run; read by
trainer.measured): one figure per GPU and precision, the best by trainer.measured.rank (the real loop
before the step alone, the newest, a default run's settings first). Torch-free: the login node plans
without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from trainer.devices import find_gpu
from trainer.measured import MeasuredMFU, load_measured, rank


@dataclass(frozen=True)
class MeasuredMfu:
    gpu: str  # the device table's name of the GPU it was measured on
    precision: str
    mfu: float  # a fraction
    what: str  # the model, sequence length, batch, kernels, what ran, commit and date
    source: str  # the results file holding the raw output, relative to the repository


@cache
def measured_recipes() -> frozenset[str]:
    """The precision recipes (autocast, master_weights, fp32) some GPU run in bench/results/mfu.json used."""
    try:
        return frozenset(r.recipe for r in load_measured() if find_gpu(r.device) is not None)
    except (OSError, ValueError):
        return frozenset()


@cache
def measured_figures() -> tuple[MeasuredMfu, ...]:
    """Every GPU's measured MFU figure (none when bench/results is not there, e.g. an installed copy).
    Read once per process."""
    try:
        rows = load_measured()
    except (OSError, ValueError):
        return ()
    best: dict[tuple[str, str], MeasuredMFU] = {}
    for r in sorted(rows, key=rank):
        gpu = find_gpu(r.device)
        if gpu is not None:
            best.setdefault((gpu.name, r.precision), r)
    return tuple(MeasuredMfu(gpu, r.precision, r.mfu,
                             f"{r.model} {r.precision}, seq {r.seq_length}, micro-batch {r.micro_batch}, "
                             f"{r.kernels} kernels, {r.recipe}, {r.what}, {r.commit} {r.date}", r.source)
                 for (gpu, _), r in best.items())
