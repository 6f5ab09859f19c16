"""Which rank failed first, and why: the reason ``status`` gives for a failed training-shaped job.

When one rank of a step ends, the others follow: their next collective fails (gloo's "Connection closed by
peer", NCCL's "remote process exited"), their hang watchdog ends them, or the launcher ends them
(``srun --kill-on-bad-exit``; the local executor's controller, orchestrator/world/local_jobs.py). Those are
consequences. Naming rank 0's communication error as the reason — what the job's own ``_FAILED`` marker
holds — blames the wrong rank, and a rank killed by a signal (the OOM killer, ``kill -9``, a lost node)
has no Python error of its own to show at all.

What is known, per rank, of the job's last attempt:

- how its process ended, from whoever started it: the local controller's ``<job>_exits.jsonl`` (exit code
  or signal, in the order it saw them) or srun's lines in the batch log (``srun: error: n2: task 1:
  Killed``, in the order srun learnt them; every task srun reports after the first was ended by
  ``--kill-on-bad-exit``);
- its last heartbeat (trainer/health): its error when Python saw one, ``hung`` when its watchdog ended it,
  or no final word at all (it died by a signal);
- the hang watchdog's record (``hangs.jsonl``): which rank stopped progressing.

The cause is the rank the watchdog named, else the first rank that ended on its own without a
communication error (a signal, an error of its own), else the first that ended. Every other rank that
ended is listed as a consequence.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.readback.logs import log_dir
from orchestrator.world.queue import read_exits, signal_name
from trainer.health import RankHealth, read_hangs
from trainer.signals import EXIT_HANG, EXIT_REQUEUE

_LOCAL_REQUEUE = 144  # submitit's local requeue code: a clean stop, as EXIT_REQUEUE
_CLEAN = (0, EXIT_REQUEUE, _LOCAL_REQUEUE)
# What a collective's failure says when a peer is gone (gloo, NCCL, torch.distributed's store).
_PEER_ERROR = re.compile(r"connection (closed|reset) by peer|broken pipe|gloo|nccl|distbackenderror|"
                         r"remote process|socket|timed out|connection refused", re.I)
# srun's line per ended task (src/srun launch plugin): "srun: error: n2: task 1: Killed",
# "srun: error: n1: tasks 0-1: Exited with exit code 70".
_SRUN = re.compile(r"srun: error: (?P<host>[^:]+): tasks? (?P<tasks>[\d,\-]+): (?P<what>.+)$")
_LONG = 300  # characters of an error's first line (a gloo error carries its source path and a URL)
_SIGNALS = {signal.strsignal(s): s for s in signal.valid_signals()
            if isinstance(s, signal.Signals) and signal.strsignal(s)}


@dataclass(frozen=True)
class TaskEnd:
    """How one rank's process ended, as its launcher saw it."""

    rank: int
    code: int  # the exit code; negative: killed by that signal
    order: int  # the order the launcher saw the ends in (ties: the same look)
    after_teardown: bool  # ended after the launcher began ending the attempt (a consequence)
    host: str = ""


@dataclass
class Verdict:
    """The first failure (one line) and the ranks that ended after it because of it."""

    cause: str
    rank: int | None
    consequences: list[str] = field(default_factory=list)


def local_ends(folder: str, job_id: str) -> list[TaskEnd]:
    """The last attempt's task ends from a local job's controller record (task k is rank k)."""
    records = read_exits(folder, job_id)
    last = max((int(r.get("attempt", 0)) for r in records), default=0)
    ends = [r for r in records if int(r.get("attempt", 0)) == last]
    return [TaskEnd(int(r["task"]), int(r["code"]), i, bool(r.get("after_teardown")))
            for i, r in enumerate(ends) if "task" in r and "code" in r]


def _tasks(spec: str) -> list[int]:
    out = []
    for part in spec.split(","):
        low, _, high = part.partition("-")
        if low.isdigit():
            out += range(int(low), int(high) + 1) if high.isdigit() else [int(low)]
    return out


def srun_ends(text: str) -> list[TaskEnd]:
    """The last step attempt's task ends from a Slurm batch log: srun's lines after the attempt before it
    (``slipway: <stage> step attempt N ... exited with``, render.py). The first line srun wrote is the
    first failure; the tasks of every later line were ended by ``--kill-on-bad-exit``."""
    lines = text.splitlines()
    ends_at = [i for i, ln in enumerate(lines) if " step attempt " in ln and " exited with " in ln]
    start = ends_at[-2] + 1 if len(ends_at) > 1 else 0
    out: list[TaskEnd] = []
    for i, line in enumerate(lines[start:ends_at[-1] if ends_at else None]):
        m = _SRUN.search(line)
        if m is None:
            continue
        what = m["what"].strip()
        code = re.match(r"Exited with exit code (\d+)", what)
        num = int(code[1]) if code else -_SIGNALS.get(what.removesuffix(" (core dumped)"), 0)
        out += [TaskEnd(t, num, i, bool(out), m["host"]) for t in _tasks(m["tasks"])]
    return out


def slurm_ends(run_dir: Path, stage: str, entry: dict) -> list[TaskEnd]:
    path = log_dir(run_dir, entry) / f"{stage}_{entry['job_id']}_batch.out"
    try:
        return srun_ends(path.read_text(errors="replace"))
    except OSError:
        return []


def _first_line(text: str) -> str:
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), "")


def _who(rank: int, beat: RankHealth | None, end: TaskEnd | None) -> str:
    host = (beat.host if beat else "") or (end.host if end else "")
    where = ", ".join(x for x in (f"on {host}" if host and host != "?" else "",
                                  f"pid {beat.pid}" if beat and beat.pid else "") if x)
    return f"rank {rank}" + (f" ({where})" if where else "")


def _how(beat: RankHealth | None, end: TaskEnd | None) -> str:
    """How one rank ended, in words."""
    at = f" at iteration {beat.iteration}" if beat and beat.iteration is not None else ""
    if end is not None and end.code < 0:
        how = f"was killed by {signal_name(-end.code)}{at}"
        return how + (" as the attempt was ended" if end.after_teardown else ", without an error of its own")
    if beat is not None and beat.state == "hung" or end is not None and end.code == EXIT_HANG:
        return f"was ended by its hang watchdog{at} (exit {EXIT_HANG})"
    if beat is not None and beat.state == "failed" and beat.message:
        line = _first_line(beat.message)
        return f"failed{at}: {line if len(line) <= _LONG else line[:_LONG] + '…'}"
    if end is not None:
        return f"exited with code {end.code}{at}"
    return f"ended{at} without an error of its own (killed by a signal, or its node was lost)"


def _own(beat: RankHealth | None, end: TaskEnd | None) -> bool:
    """It ended on its own, not as a consequence: a signal, or an error that is no communication error."""
    if end is not None and end.after_teardown:
        return False
    if end is not None and end.code < 0:
        return True
    if beat is not None and beat.state == "hung" or end is not None and end.code == EXIT_HANG:
        return False
    message = beat.message if beat is not None else ""
    return not _PEER_ERROR.search(message) if message else end is None or end.code not in _CLEAN


def first_failure(beats: list[RankHealth], ends: list[TaskEnd], hangs: list[dict]) -> Verdict | None:
    """The verdict for one ended attempt (module docstring); None when no rank failed."""
    by_beat = {b.rank: b for b in beats}
    by_end = {e.rank: e for e in ends}
    failed = {r for r, e in by_end.items() if e.code not in _CLEAN}
    failed |= {b.rank for b in beats if b.state in ("failed", "hung")}
    if not ends:  # no launcher's word: a rank whose heartbeat never said how it ended died without a word
        failed |= {b.rank for b in beats if b.state not in ("exited", "interrupted", "failed", "hung")}
    if not failed:
        return None
    named, hang = _watchdog_named(beats, hangs)
    if named is not None:
        beat, end = by_beat.get(named), by_end.get(named)
        cause = (f"{_who(named, beat, end)} stopped progressing at iteration {hang.get('iteration')}; "
                 f"the hang watchdog of rank {hang.get('reporter')} ended the step (exit {EXIT_HANG})")
        if end is not None and end.code < 0:
            cause += f", and the launcher then killed it ({signal_name(-end.code)})"
        rank = named
    else:
        order = sorted(failed, key=lambda r: (_when(by_beat.get(r), by_end.get(r)), r))
        rank = next((r for r in order if _own(by_beat.get(r), by_end.get(r))), order[0])
        cause = _said(rank, by_beat.get(rank), by_end.get(rank))
    after = [_said(r, by_beat.get(r), by_end.get(r)) for r in sorted(failed - {rank})]
    return Verdict(cause, rank, after)


def _said(rank: int, beat: RankHealth | None, end: TaskEnd | None) -> str:
    return f"{_who(rank, beat, end)} {_how(beat, end)}"


def _when(beat: RankHealth | None, end: TaskEnd | None) -> tuple[float, float]:
    """Sort key: the launcher's order, else the final heartbeat's time."""
    inf = float("inf")
    return (end.order if end is not None else inf, beat.written if beat is not None else inf)


def _watchdog_named(beats: list[RankHealth], hangs: list[dict]) -> tuple[int | None, dict]:
    """(the rank named as stopped, the record) by the first watchdog of this attempt that fired: the
    earliest hang record of a rank whose heartbeat says its watchdog ended it, at that iteration (later
    reporters of the same hang may only name ranks that had ended by then)."""
    hung = {(b.rank, b.iteration) for b in beats if b.state == "hung"}
    mine = sorted((h for h in hangs if (h.get("reporter"), h.get("iteration")) in hung),
                  key=lambda h: float(h.get("time") or 0))
    for hang in mine[:1]:
        for stopped in hang.get("stopped") or []:
            m = re.match(r"rank (\d+)", str(stopped))
            if m:
                return int(m[1]), hang
    return None, {}


def verdict(run_dir: Path, stage: str, entry: dict, beats: list[RankHealth]) -> Verdict | None:
    """The first failure of a training-shaped job's last attempt (its heartbeats ``beats``)."""
    job = str(entry["job_id"])
    if entry.get("executor") == "local":
        ends = local_ends(entry.get("folder", ""), job)
    else:
        ends = slurm_ends(run_dir, stage, entry)
        beats = [b for b in beats if b.job in (None, job)]
    return first_failure(beats, ends, read_hangs(str(run_dir)))
