"""What every bench/results/ file records about the run: date, commit, machine, load. Standard library only
(the preprocessing benchmark imports it before timing any import)."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit(paths: tuple[str, ...] = ("trainer", "csrc", "bench")) -> str:
    """Short sha of HEAD, with ``+dirty`` when ``paths`` differ from it (the measured code is not HEAD's)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    sha = git("rev-parse", "--short", "HEAD") or "unknown"
    return sha + ("+dirty" if git("status", "--porcelain", "--", *paths) else "")


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_meta() -> dict:
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": commit(),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "python": platform.python_version(),
            "load_before": load()}
