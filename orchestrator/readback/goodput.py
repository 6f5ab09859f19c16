"""The goodput lines of ``python -m orchestrator status`` and of the summary: each run's accounting over
all its training attempts (trainer.goodput: the terms, the records, the arithmetic), read from the run
directory alone."""

from __future__ import annotations

from pathlib import Path

from orchestrator.world.runs import run_dirs_of
from trainer.goodput import account, format_lines, read_records


def run_lines(run_dir: str | Path) -> list[str]:
    """One run's goodput lines ([] before its first attempt's record)."""
    return format_lines(account(read_records(str(run_dir))))


def goodput_notes(path: str) -> list[str]:
    """``GOODPUT: run R: ...`` lines below the status table, for every run under ``path`` with records."""
    out = []
    for run_dir in run_dirs_of(path):
        lines = run_lines(run_dir)
        if lines:
            out.append(f"GOODPUT: run {run_dir.name}: {lines[0]}")
            out += [f"  {line}" for line in lines[1:]]
    return ([""] if out else []) + out
