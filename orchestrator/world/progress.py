"""A training run's progress as the run directory records it (read by ``status``, ``wait`` and the plot):
the loss and tokens/s per iteration, restarts, the last checkpointed iteration, hangs and the W&B run."""

from __future__ import annotations

import re
from pathlib import Path

from orchestrator.world.runs import read_json
from trainer.checkpoint.files import parse_tracker, tracker_text
from trainer.health import read_bad_nodes, read_hangs
from trainer.metrics_file import TOKENS_PER_S, TRAIN_LOSS, read_metrics
from trainer.run_files import EXCLUSIONS, REQUEUES, RETRIES, SUBMITIT_LOG, RunDir
from trainer.wandb_online import FALLBACK_KEY, offline_dirs, sync_command

_ITER = re.compile(r"iteration\s+(\d+)/\s*(\d+)\s*\|")
_LOSS = re.compile(r"lm loss: ([0-9.Ee+-]+)")
_TOKS = re.compile(r"tokens per second: ([0-9.Ee+-]+)")


def metrics_records(run_dir: Path) -> list[tuple[int, float | None, float | None]]:
    """(iteration, loss, tokens/s) from the trainer's metrics file (rank 0; replayed iterations after a
    restart appear again, the last one wins)."""
    return [(int(row["iteration"]), float(row[TRAIN_LOSS]), row.get(TOKENS_PER_S))
            for row in read_metrics(run_dir, TRAIN_LOSS)]


def log_records(run_dir: Path, stage: str) -> list[tuple[int, float | None, float | None]]:
    """(iteration, loss, tokens/s): the trainer's metrics file, else the Megatron log lines of every log of
    the training ``stage``'s jobs (later restarts overriding)."""
    recs = metrics_records(run_dir)
    if recs:
        return recs
    by_iter: dict[int, tuple[int, float | None, float | None]] = {}
    submitit = SUBMITIT_LOG.format(job="*", task="*", stream="*")
    files = sorted(
        list(RunDir(run_dir).logs.glob(f"{stage}_*")) + list(RunDir(run_dir).jobs(stage).glob(submitit)),
        key=lambda p: p.stat().st_mtime,
    )
    for f in files:
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            m = _ITER.search(line)
            if not m:
                continue
            loss, toks = _LOSS.search(line), _TOKS.search(line)
            it = int(m.group(1))
            by_iter[it] = (
                it,
                float(loss.group(1)) if loss else by_iter.get(it, (0, None, None))[1],
                float(toks.group(1)) if toks else None,
            )
    return [by_iter[k] for k in sorted(by_iter)]


def restarts(state_dir: Path, slurm_requeues: int = 0) -> int:
    """Retries in the allocation (Slipway's) plus requeues: Slurm's count (its records) covers Slipway's
    own `scontrol requeue`s and Slurm's (a node failure); the larger of the two, as accounting may lag."""
    def lines(name: str) -> int:
        p = state_dir / name
        return len([x for x in p.read_text().splitlines() if x.strip()]) if p.exists() else 0

    return lines(RETRIES) + max(lines(REQUEUES), slurm_requeues)


def checkpoint_iter(run_dir: Path, data: dict) -> int | None:
    ck = data.get("config", {}).get("checkpoint", {}).get("dir") or str(RunDir(run_dir).checkpoints)
    try:  # the trainer's reader: Megatron's "release" is 0; a tracker naming no iteration shows as none
        return parse_tracker(tracker_text(ck))
    except OSError:
        return None


def hangs(run_dir: Path) -> list[str]:
    """One line per recorded hang (several ranks' watchdogs report the same one: merged)."""
    merged: dict[tuple, list[int]] = {}
    for h in read_hangs(str(run_dir)):
        cut = tuple(sorted(h.get("lost_contact") or ()))  # trainer/health/contact.py: the nodes cut off
        key = (h.get("job"), h.get("iteration"), tuple(h.get("stopped") or ()), cut)
        merged.setdefault(key, []).append(h.get("reporter"))
    out = []
    for (job, it, stopped, cut), reporters in merged.items():
        who = "; ".join(stopped) if stopped else \
            f"{', '.join(f'node {n}' for n in cut)} lost contact" if cut else \
            "no rank identifiable from the heartbeats"
        by = ", ".join(map(str, sorted(reporters)))
        out.append(f"{f'job {job}, ' if job else ''}iteration {it}: stopped progressing: {who} (watchdog "
                   f"fired on rank{'s' if len(reporters) > 1 else ''} {by}, exit 70)")
    return out


# A line of the batch script's exclusions file (orchestrator/render.py slipway_exclude).
_DECISION = re.compile(r"^\d+ (?P<what>excluded|kept) (?P<nodes>\S+) job=(?P<job>\S*) "
                       r"restart=(?P<restart>\d+) attempt=(?P<attempt>\d+)"
                       r"(?: exclude=(?P<all>\S+) helper=(?P<helper>\S+))?(?: why=(?P<why>.*))?$")


def _decisions(state_dir: Path) -> dict[tuple[str, int, int], dict[str, str]]:
    """The batch script's exclusion decisions by (job, restart, attempt)."""
    try:
        lines = (state_dir / EXCLUSIONS).read_text(errors="replace").splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        if m := _DECISION.match(line.strip()):
            out[(m["job"], int(m["restart"]), int(m["attempt"]))] = m.groupdict()
    return out


def bad_nodes(run_dir: Path, state_dir: Path, slurm_restarts: int = 0) -> list[str]:
    """One line per node a preflight or watchdog named (trainer/health/badnodes.py): which, why, in which
    attempt, and what the batch script did about it (``slurm_restarts``: how often Slurm's accounting says
    the job was requeued, which it does itself when a node stops answering)."""
    decided = _decisions(state_dir)
    out = []
    for rec in read_bad_nodes(str(run_dir)):
        job, restart, attempt = rec.get("job"), int(rec.get("restart", 0)), int(rec.get("attempt", 0))
        head = (f"{rec['node']} named by the {rec.get('source', 'check')} (job {job or 'local'}, restart "
                f"{restart}, attempt {attempt}): {rec.get('why', '')}")
        d = decided.get((str(job), restart, attempt))
        if job is None:
            what = "a local run: nothing to exclude"
        elif d is None and restart < slurm_restarts:
            what = ("Slurm ended that run of the job before its batch script decided (a node that stops "
                    "answering is set DOWN and the job requeued, without it)")
        elif d is None:
            what = "no decision recorded (the job is still deciding, or was cancelled)"
        elif d["what"] == "excluded":
            what = (f"excluded from the job's next allocation (ExcNodeList={d['all']}, set by helper job "
                    f"{d['helper']})")
        else:
            what = f"kept ({d['why']}); the step was retried in the same allocation"
        out.append(f"{head}; {what}")
    return out


def wandb_offline_dirs(run_dir: Path) -> list[str]:
    """Every offline W&B folder of the run's W&B run, oldest first (trainer/wandb_online.py)."""
    p = RunDir(run_dir).wandb_run
    run_id = read_json(p).get("id") if p.exists() else None
    return offline_dirs(RunDir(run_dir).wandb, run_id) if run_id else []


def wandb_offline(run_dir: Path) -> str:
    """How to upload what the run logged offline — every folder, one per job that continued the run — and,
    when online W&B fell back to offline in a job, why."""
    dirs = wandb_offline_dirs(run_dir)
    p = RunDir(run_dir).wandb_run
    fallback = read_json(p).get(FALLBACK_KEY) if p.exists() else None
    if not dirs and not isinstance(fallback, dict):
        return ""
    why = f"{fallback.get('reason')}; logged offline" if isinstance(fallback, dict) else "logged offline"
    if not dirs:  # recorded, but the folder is gone (moved, or synced and cleaned)
        return f"{why}, upload with: {fallback.get('sync')}"
    return f"{why} in {len(dirs)} folder(s), upload with: {sync_command(dirs)}"


def wandb_path(run_dir: Path, data: dict) -> str:
    p = RunDir(run_dir).wandb_run
    if not p.exists():
        return ""
    wid = read_json(p).get("id", "")
    w = data.get("config", {}).get("logging", {}).get("wandb", {})
    return "/".join(x for x in (w.get("entity"), w.get("project"), wid) if x)
