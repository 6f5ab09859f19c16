"""Heartbeat files: where each rank's lives, which node a process is on, and reading them back (status).

The writer is :class:`trainer.health.Monitor`; the reader is torch-free, so ``python -m orchestrator
status`` judges a run's ranks on the login node.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import dataclass

from trainer.faults import NODE_NAME
from trainer.run_files import RunDir

# How a rank's training ended, as its last heartbeat says: normally, by an error, by its hang watchdog, or
# interrupted (SIGINT: a local job being cancelled, Ctrl-C of a standalone run), which is no failure.
FINAL_PHASES = ("exited", "failed", "hung", "interrupted")

def node_name() -> str:
    """This process's node: ``SLIPWAY_NODE_NAME``, else Slurm's node name, else the host name (Slurm node
    names are what an admin drains; several emulated nodes may share one host)."""
    env = os.environ
    return env.get(NODE_NAME) or env.get("SLURMD_NODENAME") or socket.gethostname()


def expand_hostlist(text: str) -> list[str]:
    """Slurm hostlist → names: 'n[1-3,07],gpu' → ['n1', 'n2', 'n3', 'n07', 'gpu']."""
    out: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?([^,]*)", text):
        head, ranges, tail = m.group(1), m.group(2), m.group(3)
        if not ranges:
            out.append(head + tail)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                out.append(f"{head}{i:0{len(lo)}d}{tail}")
    return out


def heartbeat_path(run_dir: str, rank: int) -> str:
    return str(RunDir(run_dir).heartbeat(rank))


@dataclass
class RankHealth:
    """One rank's last heartbeat, judged at ``now``."""

    rank: int
    host: str
    pid: int
    iteration: int | None
    phase: str
    age_s: float  # since the heartbeat was written
    idle_s: float  # since the rank last made progress
    state: str  # ok | stale | stalled | exited | failed | hung | interrupted
    message: str = ""
    job: str | None = None  # the Slurm job that wrote it (None: a local job's, or a standalone run's)
    written: float = 0.0  # when it was written (wall time)


def judge(beat: dict, now: float, stale_after_s: float | None = None) -> RankHealth:
    """Classify one heartbeat. ``stale_after_s`` None: five heartbeat intervals, at least 30 s."""
    limit = stale_after_s if stale_after_s is not None else max(5 * float(beat.get("interval_s") or 10), 30.0)
    age = now - float(beat["time"])
    idle = now - float(beat.get("progress_time") or beat["time"])
    phase = str(beat.get("phase", "?"))
    if phase in FINAL_PHASES:
        state = phase
    elif age > limit:
        state = "stale"
    elif idle > limit and phase != "startup":
        state = "stalled"
    else:
        state = "ok"
    job = beat.get("job")
    return RankHealth(int(beat["rank"]), str(beat.get("host", "?")), int(beat.get("pid", 0)),
                      beat.get("iteration"), phase, age, idle, state, str(beat.get("message", "")),
                      None if job is None else str(job), float(beat["time"]))


def read_heartbeats(run_dir: str, now: float | None = None, stale_after_s: float | None = None
                    ) -> list[RankHealth]:
    """Every rank's judged heartbeat under ``run_dir`` (sorted by rank; unreadable files skipped)."""
    folder = str(RunDir(run_dir).heartbeats)
    if not os.path.isdir(folder):
        return []
    now = time.time() if now is None else now
    out = []
    for name in sorted(os.listdir(folder)):
        if not (name.startswith("rank_") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                out.append(judge(json.load(f), now, stale_after_s))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(out, key=lambda r: r.rank)


def summarize(ranks: list[RankHealth]) -> str:
    """One status cell: 'ok 4/4' (ranks healthy of ranks reporting; 'exited 4/4' once all have ended) or
    the problems, e.g. 'stale: rank 1@n2 (95 s)'. A bare count read as an exit code ('exited 4')."""
    if not ranks:
        return ""
    bad = [r for r in ranks if r.state not in ("ok", "exited", "interrupted")]
    if not bad:
        label = ranks[0].state if all(r.state == ranks[0].state for r in ranks) else "ok"
        return f"{label} {len(ranks)}/{len(ranks)}"
    by_state: dict[str, list[str]] = {}
    for r in bad:
        secs = r.age_s if r.state == "stale" else r.idle_s
        by_state.setdefault(r.state, []).append(f"rank {r.rank}@{r.host} ({secs:.0f} s)")
    return "; ".join(f"{state}: {', '.join(items)}" for state, items in by_state.items())


def stopped_ranks(ranks: list[RankHealth], world_size: int, reporter: int) -> list[RankHealth]:
    """The ranks the others wait for, judged by a watchdog that fired on ``reporter``: ranks whose heartbeat
    went stale, ended (failed, hung, exited, interrupted) or is missing (the process stopped, died, or its
    node is gone); failing that, the other ranks behind the others (a lower iteration). Empty when every
    other rank looks like the reporter (all alive, same iteration: no single culprit is visible from the
    heartbeats). Never the reporter itself: a rank that was stopped (SIGSTOP) and continued finds its own
    heartbeat behind, but it is not the rank it waited for."""
    found = {r.rank for r in ranks}
    missing = [RankHealth(r, "?", 0, None, "?", float("inf"), float("inf"), "missing",
                          "no heartbeat file") for r in range(world_size) if r not in found]
    ended = ("stale", "failed", "hung", "exited", "interrupted")
    gone = [r for r in ranks if r.rank != reporter and r.state in ended]
    if gone or missing:
        return sorted(gone + missing, key=lambda r: r.rank)
    its = [r.iteration for r in ranks if r.iteration is not None]
    if its and min(its) < max(its):
        return [r for r in ranks if r.iteration == min(its) and r.rank != reporter]
    return []


def describe_rank(r: RankHealth) -> str:
    if r.state == "missing":
        return f"rank {r.rank} (no heartbeat file)"
    return (f"rank {r.rank} on {r.host} (pid {r.pid}; {r.state}, heartbeat {r.age_s:.1f} s old, "
            f"iteration {'-' if r.iteration is None else r.iteration}, phase {r.phase})")


def record_hang(run_dir: str, record: dict) -> None:
    """Append one watchdog report to ``{run_dir}/hangs.jsonl`` (one short line: O_APPEND keeps the lines of
    several reporting ranks whole)."""
    with open(RunDir(run_dir).hangs, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def read_hangs(run_dir: str) -> list[dict]:
    """Every recorded watchdog report, oldest first (unparsable lines skipped)."""
    try:
        with open(RunDir(run_dir).hangs, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return [r for r in out if isinstance(r, dict)]
