"""Measured model-FLOPs utilisation per device: the committed figures of bench/results/mfu.json (written by
bench/record_mfu.py from a bench/gpu_check.sh run), for a plan's ETA instead of an assumed MFU.

Torch-free and standard-library only (the login node plans in a second). Each row is one measurement:
the device, the model (name and shape), what was measured (``trainer.run loop``: the real loop's log
lines; ``bench step``: the step alone), its settings, the MFU (Megatron's formula against the device's
dense bf16 peak), and where it comes from: date, commit and the source file. :func:`measured_mfu` picks,
for a device, the row that best describes a run of the given shape.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from trainer.devices import find_gpu

MFU_FILE = Path(__file__).resolve().parents[1] / "bench" / "results" / "mfu.json"
FORMAT = "slipway-measured-mfu/1"
LOOP, STEP = "trainer.run loop", "bench step"
SWEEP = "bench micro-batch sweep"
"""A point of bench/train_gpu.py's search for the best micro-batch (a few steps of the step alone at each
size): the rows that show how the MFU grows with the micro-batch (orchestrator/base/measured.py fits them)."""
WHAT_ORDER = (LOOP, STEP, SWEEP)  # the better evidence of a run's speed first


@dataclass(frozen=True)
class MeasuredMFU:
    """One committed measurement (a row of bench/results/mfu.json)."""

    device: str  # the GPU's name as torch reports it, e.g. "NVIDIA H200"
    model: str  # hydra_conf/model/<name>
    num_layers: int
    hidden_size: int
    seq_length: int
    what: str  # LOOP or STEP
    micro_batch: int
    precision: str
    recipe: str
    kernels: str
    attention: str  # e.g. "sdpa auto, dropout 0.1"
    tokens_per_s: float
    mfu: float  # a fraction: 0.273 is 27.3 %
    date: str  # ISO date of the measurement
    commit: str  # the commit measured
    source: str  # the committed file holding the raw output
    peak_mem_gib: float | None = None
    notes: str = ""

    def describe(self) -> str:
        return (f"{100 * self.mfu:.1f}% MFU measured on {self.device} ({self.model}, {self.what}, "
                f"micro-batch {self.micro_batch}, {self.precision} {self.recipe}, kernels {self.kernels}) at "
                f"{self.commit} on {self.date} ({self.source})")


def load_measured(path: Path | str = MFU_FILE) -> list[MeasuredMFU]:
    """Every row of the file ([] when it does not exist); a malformed file raises ValueError naming it."""
    path = Path(path)
    if not path.exists():
        return []
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not {FORMAT} (a dict with 'format' and 'rows'); regenerate it with "
                         "bench/record_mfu.py")
    names = {f.name for f in fields(MeasuredMFU)}
    try:
        return [MeasuredMFU(**{k: v for k, v in row.items() if k in names}) for row in data["rows"]]
    except TypeError as e:
        raise ValueError(f"{path}: a row lacks a field of MeasuredMFU ({e})") from e


def _same_device(configured: str, measured: str) -> bool:
    """One GPU by the device table (trainer.devices: "H200" and "NVIDIA H200" are one entry); a name the
    table lacks must match the measured one word for word (case and "NVIDIA" aside)."""
    a, b = find_gpu(configured), find_gpu(measured)
    if a is not None or b is not None:
        return a == b
    words = [set(s.lower().replace("nvidia", "").replace("-", " ").split()) for s in (configured, measured)]
    return bool(words[0]) and words[0] == words[1]


DEFAULT_SETTINGS = ("csrc", "autocast")
"""The kernels and recipe of a default run on CUDA (kernels=auto without apex, precision_recipe=auto)."""


def rank(r: MeasuredMFU, num_layers: int | None = None, hidden_size: int | None = None) -> tuple:
    """Sort key, best first, of the rows that describe a run: its shape (layers, hidden) first, else the
    model closest in hidden size; the real loop before the bench step before a micro-batch sweep's point
    (:data:`WHAT_ORDER`); the newest; the default settings (and no deliberate per-step sync) before other
    rows; the higher MFU."""
    same = num_layers is None or (num_layers, hidden_size) == (r.num_layers, r.hidden_size)
    distance = abs(r.hidden_size - hidden_size) if hidden_size else 0
    default = (r.kernels, r.recipe) == DEFAULT_SETTINGS and "sync every step" not in r.notes
    what = WHAT_ORDER.index(r.what) if r.what in WHAT_ORDER else len(WHAT_ORDER)
    return (not same, distance, what, _neg_date(r.date), not default, -r.mfu)


def measured_mfu(device_name: str, num_layers: int | None = None, hidden_size: int | None = None,
                 path: Path | str = MFU_FILE) -> MeasuredMFU | None:
    """The committed figure for ``device_name`` (``cluster.device_name``: "H200" matches "NVIDIA H200"),
    best by :func:`rank` for a run of the given shape; None when the device was never measured."""
    rows = [r for r in load_measured(path) if _same_device(device_name, r.device)]
    return min(rows, key=lambda r: rank(r, num_layers, hidden_size)) if rows else None


def _neg_date(date: str) -> tuple[int, ...]:
    return tuple(-int(x) for x in date[:10].split("-") if x.isdigit())
