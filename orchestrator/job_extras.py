"""Small pieces the training job runs around the trainer: the data report and the stall test hook.

- :func:`write_data_report`: the preprocessing summaries of the run's data (documents, tokens, and with
  ``data.on_error=skip`` every dropped line as file:line and reason) copied into ``<run_dir>/
  data_report.json``, so a run's directory says what its data lost even though the preprocessed data lives
  in the shared cache.
- :func:`stall_hook`: the ``stall_train`` test hook. After iteration N (once per run and rank) the rank
  pauses until a signal arrives (Slurm's time-limit USR2, a preemption, srun's kill after another rank
  died) or ``max_s`` passes, so fault tests act at a known iteration instead of racing a fast run. The
  wait wakes on any signal that has a Python handler through ``signal.set_wakeup_fd``; the trainer's own
  handler then stops the run at this step boundary.
"""

from __future__ import annotations

import json
import os
import select
import signal
import time
from collections.abc import Callable
from pathlib import Path

from trainer.log import get_logger

log = get_logger(__name__)

DATA_REPORT = "data_report.json"


def write_data_report(summaries: list[str], run_dir: str) -> Path | None:
    """Merge the preprocessing summary files into ``<run_dir>/data_report.json`` (None when none exist)."""
    found = [json.loads(Path(p).read_text()) for p in summaries if Path(p).is_file()]
    if not found:
        return None
    skipped: dict[str, int] = {}
    for s in found:
        for reason, n in s.get("skipped", {}).items():
            skipped[reason] = skipped.get(reason, 0) + n
    report = {
        "skipped_lines": sum(skipped.values()),
        "skipped": skipped,
        "skipped_examples": [e for s in found for e in s.get("skipped_examples", [])],
        "summaries": found,
    }
    out = Path(run_dir) / DATA_REPORT
    tmp = out.with_name(f"{DATA_REPORT}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, out)
    if report["skipped_lines"]:
        log.warning("the run's data dropped %d bad input line(s) (data.on_error=skip); see %s",
                    report["skipped_lines"], out)
    return out


def _wakeup_pipe() -> int:
    """A pipe that receives a byte for every signal handled in Python (read end returned)."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    return r


def stall_hook(iteration: int, marker_dir: str, rank: int, max_s: float = 600.0
               ) -> Callable[[int, float], None]:
    """``on_step`` callback: pause after ``iteration`` until a signal (see the module docstring).

    Call it in the main thread before the trainer starts, so a signal that comes early is not missed.
    The marker ``stalled_<iteration>_rank<rank>`` (written when the pause starts) makes it once per run:
    a retry that replays the iteration passes through, and tests watch for it.
    """
    wake = _wakeup_pipe()
    marker = Path(marker_dir) / f"stalled_{iteration}_rank{rank}"

    def on_step(it: int, loss: float) -> None:
        if it != iteration or marker.exists():
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{time.time()}\n")
        log.warning("stall_train=%d (test hook): pausing until a signal arrives", iteration)
        ready, _, _ = select.select([wake], [], [], max_s)
        log.warning("stall_train: %s", "signal received, continuing" if ready else "no signal, continuing")

    return on_step
