"""The MFU figures measured on real GPUs (bench/), as the plan's ETA uses them.

:func:`measured_figures` is the one reader on the orchestrator's side, over the committed machine-readable
figures (bench/results/mfu.json, written by bench/record_mfu.py from a bench/gpu_check.sh run; read by
trainer.measured): one figure per GPU and precision, the best by trainer.measured.rank (the real loop
before the step alone, the newest, a default run's settings first), with the size of the matrix products it
was measured at. :func:`efficiency_curves` fits how the MFU grows with that size to the micro-batch sweeps
the same file holds (trainer.measured.SWEEP rows), so the estimate can scale a figure to another
micro-batch. Torch-free: the login node plans without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from trainer.devices import find_gpu
from trainer.measured import SWEEP, MeasuredMFU, load_measured, rank
from trainer.time_formulas import fit_saturation, gemm_size, saturation

MIN_SWEEP = 3  # sizes a sweep needs before its curve is used: two fix the two parameters, a third tests them


@dataclass(frozen=True)
class MeasuredMfu:
    gpu: str  # the device table's name of the GPU it was measured on
    precision: str
    mfu: float  # a fraction
    what: str  # the model, sequence length, batch, kernels, what ran, commit and date
    source: str  # the results file holding the raw output, relative to the repository
    size: float = float("inf")  # the matrix products' size it was measured at (time_formulas.gemm_size)


@dataclass(frozen=True)
class EfficiencyCurve:
    """How the MFU of one GPU grows with the size of the matrix products (time_formulas.saturation),
    fitted by least squares to a micro-batch sweep measured on it."""

    gpu: str
    precision: str
    top: float  # the fitted MFU at saturation
    half: float  # the size (tokens · hidden² / tp) at which the fit reaches half of it
    hidden: int  # the swept model's hidden size and sequence length
    seq: int
    points: tuple[tuple[int, float], ...]  # (micro-batch, measured MFU), smallest first
    what: str  # the model, kernels, commit and date
    source: str

    def efficiency(self, size: float) -> float:
        return saturation(size, self.half)

    def tokens_at_half(self, hidden: int, tp: int = 1) -> float:
        """Tokens per micro-batch and device at which a model of ``hidden`` at ``tp`` reaches half speed."""
        return self.half * max(tp, 1) / hidden**2


def _rows() -> list[MeasuredMFU]:
    try:
        return load_measured()
    except (OSError, ValueError):
        return []  # bench/results is not there (an installed copy), or a broken file (test_measured says)


@cache
def measured_recipes() -> frozenset[str]:
    """The precision recipes (autocast, master_weights, fp32) some GPU run in bench/results/mfu.json used."""
    return frozenset(r.recipe for r in _rows() if find_gpu(r.device) is not None)


@cache
def measured_figures() -> tuple[MeasuredMfu, ...]:
    """Every GPU's measured MFU figure (none when bench/results is not there, e.g. an installed copy).
    Read once per process."""
    best: dict[tuple[str, str], MeasuredMFU] = {}
    for r in sorted(_rows(), key=rank):
        gpu = find_gpu(r.device)
        if gpu is not None:
            best.setdefault((gpu.name, r.precision), r)
    return tuple(MeasuredMfu(gpu, r.precision, r.mfu,
                             f"{r.model} {r.precision}, seq {r.seq_length}, micro-batch {r.micro_batch}, "
                             f"{r.kernels} kernels, {r.recipe}, {r.what}, {r.commit} {r.date}", r.source,
                             gemm_size(r.micro_batch, r.seq_length, r.hidden_size))
                 for (gpu, _), r in best.items())


@cache
def efficiency_curves() -> tuple[EfficiencyCurve, ...]:
    """One curve per GPU and precision: the newest micro-batch sweep of at least :data:`MIN_SWEEP` sizes
    (its rows share the device, model, settings and commit), fitted. Read once per process."""
    sweeps: dict[tuple, list[MeasuredMFU]] = {}
    for r in _rows():
        gpu = find_gpu(r.device)
        if r.what == SWEEP and gpu is not None:
            key = (gpu.name, r.precision, r.model, r.kernels, r.recipe, r.attention, r.commit, r.date)
            sweeps.setdefault(key, []).append(r)
    best: dict[tuple[str, str], EfficiencyCurve] = {}
    for key, rows in sorted(sweeps.items(), key=lambda kv: kv[0][-1], reverse=True):  # the newest first
        rows = sorted(rows, key=lambda r: r.micro_batch)
        if len({r.micro_batch for r in rows}) < MIN_SWEEP or key[:2] in best:
            continue
        r = rows[0]
        sizes = [gemm_size(x.micro_batch, x.seq_length, x.hidden_size) for x in rows]
        top, half = fit_saturation([(size, x.mfu) for size, x in zip(sizes, rows, strict=True)])
        best[key[:2]] = EfficiencyCurve(
            key[0], r.precision, top, half, r.hidden_size, r.seq_length,
            tuple((x.micro_batch, x.mfu) for x in rows),
            f"{r.model} {r.precision}, seq {r.seq_length}, micro-batches "
            f"{', '.join(str(x.micro_batch) for x in rows)}, {r.kernels} kernels, {r.commit} {r.date}",
            r.source)
    return tuple(best.values())
