"""What every bench/results/ file records about the run: date, commit, machine, load. Standard library only
(the preprocessing benchmark imports it before timing any import)."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    """git's output, or "" where there is no git or no repository (the GPU machine gets a copy of the
    working tree, which may have neither: bench/gpu_check.sh prints SLIPWAY_COMMIT there)."""
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.rstrip("\n")
    except OSError:
        return ""


def commit(paths: tuple[str, ...] = ("trainer", "csrc", "bench")) -> str:
    """Short sha of HEAD, with ``+dirty`` when ``paths`` differ from it (the measured code is not HEAD's)."""
    return (_git("rev-parse", "--short", "HEAD") or "unknown") + ("+dirty" if dirty(paths) else "")


def dirty(paths: tuple[str, ...] = ("trainer", "csrc", "bench")) -> list[str]:
    """Files under ``paths`` that differ from HEAD (uncommitted edits are part of what was measured)."""
    lines = _git("status", "--porcelain", "--", *paths).splitlines()
    return [line[3:] for line in lines if not line[3:].startswith("bench/results/")]


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_meta() -> dict:
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": commit(),
            "dirty": dirty(), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "python": platform.python_version(), "load_before": load()}
