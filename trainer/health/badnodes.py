"""Nodes a check found bad: the start-up preflight (a node that did not answer, or was far slower) and the
hang watchdog (the node of the rank the others waited for). Torch-free.

:func:`record_bad_nodes` writes each named node twice:

- one JSON line in ``<run_dir>/bad_nodes.jsonl`` (node, why, which check, job, restart, attempt): the
  history ``status`` shows, kept across attempts and relaunches;
- in a Slurm job, this attempt's marker ``<run_dir>/bad_nodes/<job>_r<restart>_a<attempt>.<reporter>``,
  one ``<node>\\t<why>`` line per node: the batch script (orchestrator/render.py) reads the markers of the
  attempt that just failed and keeps those nodes out of the job's next allocation. One file per reporting
  process, so ranks reporting at the same moment never overwrite each other.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping

from trainer.run_files import ATTEMPT_ENV, BAD_NODES_MARKER, RunDir

PREFLIGHT, WATCHDOG = "preflight", "watchdog"


def _attempt(environ: Mapping[str, str]) -> tuple[str | None, str, str]:
    """(Slurm job id or None, restart, attempt) of this process, as the batch script numbers them."""
    return environ.get("SLURM_JOB_ID"), environ.get("SLURM_RESTART_COUNT", "0"), environ.get(ATTEMPT_ENV, "0")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())[:500]


def record_bad_nodes(run_dir: str, nodes: Mapping[str, str], source: str,
                     environ: Mapping[str, str] | None = None) -> None:
    """Record ``nodes`` ({node: why}) named by ``source`` (:data:`PREFLIGHT` or :data:`WATCHDOG`). Errors
    are the caller's: a check that fails anyway must still say why it failed."""
    if not nodes:
        return
    env = os.environ if environ is None else environ
    job, restart, attempt = _attempt(env)
    rd = RunDir(run_dir)
    now = time.time()
    lines = "".join(json.dumps({"time": now, "node": n, "why": _one_line(w), "source": source, "job": job,
                                "restart": int(restart), "attempt": int(attempt)}) + "\n"
                    for n, w in sorted(nodes.items()))
    with open(rd.bad_nodes, "a", encoding="utf-8") as f:  # O_APPEND: whole lines from several reporters
        f.write(lines)
    if job is None:
        return  # not a Slurm job: no batch script to exclude the node from a next allocation
    rd.bad_nodes_dir.mkdir(parents=True, exist_ok=True)
    reporter = f"{socket.gethostname()}-{os.getpid()}"
    path = rd.bad_nodes_dir / BAD_NODES_MARKER.format(job=job, restart=restart, attempt=attempt,
                                                       reporter=reporter)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(f"{n}\t{source}: {_one_line(w)}\n" for n, w in sorted(nodes.items())))
    os.replace(tmp, path)


def read_bad_nodes(run_dir: str) -> list[dict]:
    """Every recorded node, oldest first, one per (job, restart, attempt, node) however many ranks named
    it; unreadable lines skipped."""
    try:
        text = RunDir(run_dir).bad_nodes.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    seen, out = set(), []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or not rec.get("node"):
            continue
        key = (rec.get("job"), rec.get("restart"), rec.get("attempt"), rec["node"])
        if key not in seen:
            seen.add(key)
            out.append(rec)
    return out
