"""``{run_dir}/train_metrics.jsonl``: the trainer's log-line values, one JSON object per line (rank 0).

Torch-free on purpose: the orchestrator reads this file on login nodes (status, summary) and the
conversion hook reads it for the model card; trainer.run.loop appends to it.

A resumed run re-logs the iterations after its last checkpoint; it first drops them from the file
(:func:`truncate_after`), so the file holds each record once. Readers agree with that rule for files
written before it: one iteration can own several records of different kinds (the train log line and the
validation result are separate records at an eval iteration), so replays are resolved per *kind*:
:func:`read_metrics` takes the key that identifies the kind ("train/lm_loss", "valid/lm_loss") and keeps,
per iteration, the last record that has it (the replay, as truncation would have left it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from trainer.run_files import METRICS

TRAIN_LOSS = "train/lm_loss"
VALID_LOSS = "valid/lm_loss"
TOKENS_PER_S = "perf/tokens_per_s"
KERNEL_CHECK = "kernel_check"  # the start-up kernel self-check's verdict (trainer/ops/selfcheck.py)
KERNEL_BUILDS = "kernel_builds"  # which trainer._C each rank loaded, and its Python (trainer/run/kernels.py)


def metrics_path(run_dir: str | os.PathLike) -> str:
    return os.path.join(run_dir, METRICS)


def append_record(path: str, row: dict) -> None:
    """Append one record (one JSON line) to the metrics file at ``path``."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def truncate_after(path: str, iteration: int) -> int:
    """Drop the records after ``iteration`` (the checkpoint a restart resumes from), so the iterations it
    replays are written once, not twice: the file never holds a replay, whoever reads it. Atomic (a
    rewrite renamed into place); untouched when there is nothing to drop. Returns the records dropped."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return 0
    keep = []
    for line in lines:
        try:
            it = _iteration(json.loads(line))
        except ValueError:
            it = None  # a torn last line of a killed writer: dropped with the replayed records
        if it is not None and it <= iteration:
            keep.append(line)
    if len(keep) == len(lines):
        return 0
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
    return len(lines) - len(keep)


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


def last_record(run_dir: str | os.PathLike, key: str, window: int = 1 << 16) -> dict | None:
    """The last record that has ``key``, read from the end of the file (``python -m orchestrator list``
    looks at many runs; a long run's file holds hundreds of thousands of lines). Since a resumed run
    truncates its replayed records first (:func:`truncate_after`), the last record in the file is the
    latest; a window without one (a long validation stretch) doubles until the whole file is read."""
    path = Path(metrics_path(run_dir))
    try:
        size = path.stat().st_size
    except OSError:
        return None
    while True:
        with open(path, "rb") as f:
            f.seek(max(size - window, 0))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
        if window < size:
            lines = lines[1:]  # the first line of the window may be cut
        for line in reversed(lines):
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if _iteration(row) is not None and key in row:
                return row
        if window >= size:
            return None
        window *= 4


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


def last_kernel_check(run_dir: str | os.PathLike) -> dict | None:
    """The newest kernel self-check verdict (the last written: each start of the job writes one)."""
    found = [row[KERNEL_CHECK] for row in read_records(run_dir) if isinstance(row.get(KERNEL_CHECK), dict)]
    return found[-1] if found else None


def kernel_fallbacks(check: dict | None) -> list[str]:
    """One line per op the self-check switched to eager (or, under ``fail``, stopped the job for)."""
    if not check:
        return []
    out = []
    for f in check.get("fallbacks", []):
        where = " ".join(x for x in (f.get("dtype"), f.get("what")) if x)
        what = (f"raised ({f['error']})" if f.get("error") else
                f"max error {_num(f.get('max_error'))} > tolerance {_num(f.get('tolerance'))}"
                + (f" ({where})" if where else ""))
        then = "the job stopped (train.kernel_check=fail)" if check.get("policy") == "fail" else "eager used"
        out.append(f"{f['op']} ({f.get('impl', '?')}) on {check.get('device', '?')} rank {f.get('rank', 0)}: "
                   f"{what}; {then}")
    return out


def kernel_cell(check: dict | None) -> str:
    """The status health cell's kernel part: '' when every checked op agreed."""
    if not check or not check.get("fallbacks"):
        return ""
    ops = ",".join(f["op"] for f in check["fallbacks"])
    return f"kernels FAILED: {ops}" if check.get("policy") == "fail" else f"kernels eager: {ops}"


def _num(x: object) -> str:
    return "inf" if x is None else f"{float(x):.3g}"
