"""The MFU figures measured on real GPUs (bench/), as the plan's ETA uses them.

:func:`measured_figures` is the one reader: today it takes the single committed GPU run's training-step
table (bench/gpu_check.sh → bench/results/gpu_check_*.txt, bench/train_gpu.py's output: CodeParrot-small,
bf16, one H200); when bench/ writes its figures in a machine-readable file, only this function changes.
Torch-free: the login node plans without it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from trainer.devices import find_gpu

REPO = Path(__file__).resolve().parent.parent
# The first GPU run (commit f24446f, 2026-12-04, one NVIDIA H200; bench/README.md, "GPU").
GPU_CHECK = REPO / "bench" / "results" / "gpu_check_20261204T131708Z.txt"
KERNELS = "csrc"  # the row of Slipway's own kernels: what kernels=auto runs on CUDA without apex

# bench/train_gpu.py's header and table rows, e.g.
#   NVIDIA H200  torch 2.11.0+cu130  model codeparrot_small (12x768, vocab 32768) seq 1024 bf16  peak 989.0
#   csrc        64    188.0     348641    269.8  27.3%   6.634    30.1  csrc: bias_gelu, ...
_HEADER = re.compile(r"^(?P<gpu>\S.*?)\s{2,}torch \S+\s+model (?P<model>\S+) .*?seq (?P<seq>\d+) "
                     r"(?P<precision>bf16|fp16|fp32)\s+peak (?P<peak>[\d.]+)", re.M)
_ROW = re.compile(rf"^{KERNELS}\s+(?P<batch>\d+)\s+[\d.]+\s+\d+\s+[\d.]+\s+(?P<mfu>[\d.]+)%", re.M)


@dataclass(frozen=True)
class MeasuredMfu:
    gpu: str  # the device table's name of the GPU it was measured on
    precision: str
    mfu: float  # a fraction
    what: str  # the model, sequence length, batch and kernels it was measured with
    source: str  # the results file, relative to the repository


@cache
def measured_figures() -> tuple[MeasuredMfu, ...]:
    """Every measured MFU figure bench/ holds (none when the results are not there, e.g. an installed
    copy without bench/). Read once per process."""
    try:
        text = GPU_CHECK.read_text(encoding="utf-8")
    except OSError:
        return ()
    head, row = _HEADER.search(text), _ROW.search(text)
    gpu = find_gpu(head["gpu"]) if head else None
    if head is None or row is None or gpu is None:
        return ()
    what = (f"{head['model']} {head['precision']}, seq {head['seq']}, micro-batch {row['batch']}, "
            f"{KERNELS} kernels, of {float(head['peak']):g} TFLOP/s")
    return (MeasuredMfu(gpu.name, head["precision"], float(row["mfu"]) / 100, what,
                        str(GPU_CHECK.relative_to(REPO))),)
