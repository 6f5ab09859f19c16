"""``{run_dir}/train_metrics.jsonl``: the trainer's log-line values, one JSON object per line (rank 0).

Torch-free on purpose: the orchestrator reads this file on login nodes (status, summary) and the
conversion hook reads it for the model card; trainer.training only appends to it.

One iteration can own several records of different kinds (the train log line and the validation
result are separate records at an eval iteration), and a resumed run re-logs the iterations after its
last checkpoint. So replays are resolved per *kind*: :func:`read_metrics` takes the key that identifies
the kind ("train/lm_loss", "valid/lm_loss") and keeps, per iteration, the last record that has it.
Keeping only the last record per iteration regardless of kind would drop the train record of every
eval iteration.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

METRICS_FILE = "train_metrics.jsonl"
TRAIN_LOSS = "train/lm_loss"
VALID_LOSS = "valid/lm_loss"
TOKENS_PER_S = "perf/tokens_per_s"


def metrics_path(run_dir: str | os.PathLike) -> str:
    return os.path.join(run_dir, METRICS_FILE)


def _iteration(row: object) -> int | None:
    """A record's iteration, or None when the line is not a record the trainer writes."""
    if not isinstance(row, dict):
        return None
    try:
        return int(row["iteration"])
    except (KeyError, TypeError, ValueError):
        return None


def read_records(run_dir: str | os.PathLike) -> list[dict]:
    """Every record in write order. A missing file is no records (the run has not logged yet); a line
    that does not parse (the last one of a killed writer, or a damaged byte) is skipped, as is one
    without an integer ``iteration``."""
    path = Path(metrics_path(run_dir))
    if not path.is_file():
        return []
    # errors="replace": a damaged byte costs its line (which then fails to parse), not the whole file.
    text = path.read_text(encoding="utf-8", errors="replace")
    records = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if _iteration(row) is not None:
            records.append(row)
    return records


def read_metrics(run_dir: str | os.PathLike, key: str) -> list[dict]:
    """The records that have ``key``, in iteration order; a replayed iteration keeps its last record."""
    by_iter: dict[int, dict] = {}
    for row in read_records(run_dir):
        if key in row:
            by_iter[int(row["iteration"])] = row
    return [by_iter[i] for i in sorted(by_iter)]


def series(run_dir: str | os.PathLike, key: str) -> list[tuple[int, float]]:
    """(iteration, value of ``key``) in iteration order, replays resolved as in :func:`read_metrics`."""
    return [(int(row["iteration"]), float(row[key])) for row in read_metrics(run_dir, key)]


def last_at_or_before(run_dir: str | os.PathLike, key: str, iteration: int) -> dict | None:
    """The record with ``key`` at the highest iteration <= ``iteration`` (None if there is none)."""
    found = [row for row in read_metrics(run_dir, key) if int(row["iteration"]) <= iteration]
    return found[-1] if found else None
