"""Where every job of a run or sweep stands: one ``squeue`` and one ``sacct`` call per look (queue.py).

Every row has the job's state and, for a failed or cancelled one, why; each stage adds its own columns
(its ``status``, orchestrator/stages/): training its loss, checkpoint, restarts, heartbeats and W&B run
(read by orchestrator/world/progress.py), eval its pass@1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.readback.culprit import Verdict, verdict
from orchestrator.record import launches
from orchestrator.record.launches import INCOMPLETE, current, history, is_incomplete
from orchestrator.stages import get as stage_def
from orchestrator.stages.base import StageLook
from orchestrator.stages.train import NAME as TRAIN
from orchestrator.world.progress import log_records
from orchestrator.world.queue import (
    CANCELLED,
    FAILED,
    LOCAL_PENDING_REASON,
    PENDING,
    alive,
    category,
    forgotten_state,
    local_state,
    marker_of,
    query_slurm_checked,
)
from orchestrator.world.runs import run_dirs_of
from trainer.health import RankHealth
from trainer.run_files import FAILED as FAILED_MARKER
from trainer.run_files import FATAL_MARKER


@dataclass
class JobRow:
    run: str
    stage: str
    job_id: str
    state: str
    reason: str = ""
    restarts: int = 0
    checkpoint_iter: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    wandb: str = ""
    log: str = ""
    health: str = ""  # heartbeats: "ok 4/4", or the stale/stalled/hung ranks with their hosts
    ranks: list[RankHealth] = field(default_factory=list)
    checkpoint_warnings: list[str] = field(default_factory=list)  # damaged/skipped at load (trainer)
    kernel_fallbacks: list[str] = field(default_factory=list)  # ops the start-up self-check refused
    slurm_error: str = ""  # squeue failed: slurmctld unreachable, the state is accounting's
    pass_at_1: float | None = None  # eval rows: HumanEval pass@1 from <run_dir>/eval/results.json
    name: str = ""  # the run's name (a sweep point's: run id and overrides)
    wandb_offline: str = ""  # online W&B fell back to offline: why, and the `wandb sync` command
    failure: str = ""  # a failed or cancelled stage: why (its error, the trainer's verdict, or Slurm's)
    hangs: list[str] = field(default_factory=list)  # every hang a watchdog recorded (kept across retries)
    overrides: str = ""  # a sweep point's overrides (lr ...): what tells the points apart
    bad_nodes: list[str] = field(default_factory=list)  # nodes a preflight/watchdog named, what was done
    note: str = ""  # what a stage says below the table (the tune stage: its trials and the decision)
    # a failed training job: the rank that failed first and those that ended because of it (culprit.py)
    first_rank: int | None = None
    consequences: list[str] = field(default_factory=list)


def _failure(state: str, entry: dict, acct: dict, first: Verdict | None = None) -> str:
    """Why a stage that failed or was cancelled ended: the trainer's own verdict (the newest ``fatal_*``
    marker of this job), else the rank that failed first and why (``first``: readback/culprit.py), else
    the error its callable recorded (this job's ``_FAILED``: rank 0's, which may only be the consequence),
    else what Slurm says. Markers an earlier job left are never this job's reason."""
    if category(state) not in (FAILED, CANCELLED):
        return ""
    state_dir = Path(entry.get("state_dir", ""))
    marker = marker_of(state_dir, FAILED_MARKER, str(entry["job_id"])) or {}
    reason = first.cause if first is not None else marker.get("reason") or marker.get("error")
    pattern = FATAL_MARKER.format(job=entry["job_id"], restart="*", attempt="*")
    fatal = sorted(state_dir.glob(pattern), key=lambda p: p.stat().st_mtime)
    if fatal:
        code, _, verdict = fatal[-1].read_text(errors="replace").strip().partition(" ")
        reason = f"{verdict} (exit {code})" if verdict else reason
    if not reason:
        exit_code = acct.get("exit", "")
        why = ", ".join(x for x in (f"exit code {exit_code}" if exit_code else "", acct.get("reason", ""))
                        if x and x != "None")
        cancelled = ("cancelled by Slipway (Ctrl-C or a signal to launch.py, or python -m orchestrator "
                     "cancel); launch the same run_id again to resume" if entry.get("executor") == "local"
                     else "cancelled: scancel, or an upstream stage failed (afterok)")
        hint = (cancelled if category(state) == CANCELLED
                else FORGOTTEN if state == "ENDED" and entry.get("executor", "slurm") == "slurm"
                else "no error was recorded (killed, or lost its node?)")
        reason = f"{state}{f' ({why})' if why else ''}; {hint}"
    return str(reason).splitlines()[0] if str(reason).strip() else state


# Why a Slurm job's state is ENDED (queue.forgotten_state): known to neither squeue nor accounting.
FORGOTTEN = ("Slurm no longer knows this job (slurmctld drops an ended job after MinJobAge; accounting, "
             "sacct, has no record of it either) and its stage left no marker: how it ended was not recorded")


def job_state(entry: dict, launch: dict, sq: dict, sa: dict, squeue_answered: bool = True
              ) -> tuple[str, str]:
    """(state, pending reason) of one recorded job: a local one's from its process and files, a Slurm
    one's from squeue (``sq``), else accounting (``sa``), else (squeue answered without it: it ended) its
    stage's markers. ``launch``: its launch's record (cancellations)."""
    jid = str(entry["job_id"])
    if entry.get("executor") == "local":
        state = local_state(entry, jid in launch.get("cancelled", ()))
        return state, LOCAL_PENDING_REASON if category(state) == PENDING else ""
    if jid in sq:
        state, reason = sq[jid]
    elif jid not in sa and squeue_answered:
        return forgotten_state(entry), ""
    else:
        state, reason = sa.get(jid, {}).get("state", "UNKNOWN"), sa.get(jid, {}).get("reason", "")
    # Slurm keeps a job's last pending reason ("Dependency") after it ran; only a job still waiting has one
    # (an ended one that failed gets its reason line below the status table).
    return state, reason if category(state) == PENDING else ""


def slurm_ids(launches_: list[dict]) -> list[str]:
    """The Slurm job ids of these launch records (one squeue + one sacct call asks about all of them)."""
    return [e["job_id"] for d in launches_ for es in d.get("jobs", {}).values() for e in es
            if e.get("executor", "slurm") == "slurm"]


def records(path: str) -> tuple[list[tuple[Path, dict]], list[str]]:
    """(run dir, run.json) of every readable run under ``path``, and one line per run whose record is
    damaged (status shows the others and says what is wrong with it, instead of failing)."""
    good, notes = [], []
    for run_dir in run_dirs_of(path):
        try:
            good.append((run_dir, launches.relocated(launches.read(run_dir), run_dir)))
        except launches.RunRecordError as err:
            notes.append(f"RUN RECORD: run {run_dir.name}: {err}")
    return good, notes


def collect(path: str, stale_after_s: float | None = None) -> list[JobRow]:
    """Rows for every stage of every run under ``path`` (a run dir or a sweep dir). A training rank whose
    heartbeat is older than ``stale_after_s`` (default: five heartbeat intervals, at least 30 s) is stale."""
    runs = records(path)[0]
    # status shows each run's latest launch (launches.py); --history lists all of them
    metas = [(r, {**current(d), "name": d.get("name")}) for r, d in runs]
    sq, sa, squeue_error = query_slurm_checked(slurm_ids([d for _, d in metas]))
    rows = []
    for run_dir, data in metas:
        for stage, entries in data.get("jobs", {}).items():
            e = entries[-1]
            jid = str(e["job_id"])
            state, reason = job_state(e, data, sq, sa, not squeue_error)
            row = JobRow(run_dir.name, stage, jid, state, reason, name=str(data.get("name") or run_dir.name),
                         overrides=" ".join((data.get("sweep") or {}).get("overrides") or ()))
            if squeue_error and e.get("executor") == "slurm":
                row.slurm_error = squeue_error
            definition = stage_def(stage)  # None: a stage this version does not know (an old run's record)
            if definition is not None:
                look = StageLook(run_dir, e, data, sa.get(jid, {}), stale_after_s, state)
                row = dataclasses.replace(row, **definition.status(look))
            first = verdict(run_dir, stage, e, row.ranks) if category(state) == FAILED and row.ranks else None
            row.failure = _failure(state, e, sa.get(jid, {}), first)
            if first is not None:
                row.first_rank, row.consequences = first.rank, first.consequences
            rows.append(row)
    return rows


def format_rows(rows: list[JobRow]) -> str:
    """The table; a sweep's rows carry their point's overrides beside the run."""
    point = any(r.overrides for r in rows)
    varies = _varying({r.run: r.overrides for r in rows})
    head = ("run", *(("point",) if point else ()), "stage", "job", "state", "reason", "restarts", "ckpt",
            "loss", "tok/s", "pass@1", "health", "wandb", "log")
    table = [head] + [
        (
            r.run,
            *((varies[r.run],) if point else ()),
            r.stage,
            r.job_id,
            r.state,
            r.reason,
            str(r.restarts),
            "" if r.checkpoint_iter is None else str(r.checkpoint_iter),
            "" if r.loss is None else f"{r.loss:.4f}",
            "" if r.tokens_per_s is None else f"{r.tokens_per_s:.0f}",
            "" if r.pass_at_1 is None else f"{r.pass_at_1:.4f}",
            r.health,
            r.wandb,
            r.log,
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table]
    warn = [slurm_note(e) for e in sorted({r.slurm_error for r in rows if r.slurm_error})]
    return "\n".join(lines + best_point(rows) + rank_problems(rows) + ([""] + warn if warn else []))


def _varying(overrides: dict[str, str]) -> dict[str, str]:
    """Each run's overrides without those every run shares (a sweep's point column: what varies)."""
    sets = [set(o.split()) for o in overrides.values()]
    common = set.intersection(*sets) if len(sets) > 1 else set()
    return {run: " ".join(x for x in o.split() if x not in common) for run, o in overrides.items()}


def slurm_note(squeue_error: str) -> str:
    """The line under a table whose Slurm states came from accounting alone (squeue failed)."""
    return (f"SLURM: slurmctld did not answer ({squeue_error}); states above come from accounting (sacct) "
            "and may be stale")


def launch_notes(path: str, rows: list[JobRow] | None = None) -> list[str]:
    """A line for every run whose latest launch stopped before it submitted everything, and for every run
    read from another place than it was launched at (moved: launches.relocated). ``rows``: the table's
    (:func:`collect`), whose states say which of those runs still has a job queued or running."""
    runs, out = records(path)
    rows = collect(path) if rows is None else rows
    for run_dir, data in runs:
        out += moved_note(run_dir)
        r = current(data)
        if r and (r.get("state") == INCOMPLETE or is_incomplete(r)):
            out.append(_incomplete(run_dir, data, r, [x for x in rows if x.run == run_dir.name]))
    return ([""] if out else []) + out


def _incomplete(run_dir: Path, data: dict, r: dict, rows: list[JobRow]) -> str:
    """The line for a launch that stopped early: relaunch it, or, while a job of the run is still queued
    or running (a relaunch would be refused as run_active: writer_lock), wait for it or cancel it first."""
    pending = ", ".join(r.get("pending", {})) or "nothing pending"
    head = (f"LAUNCH INCOMPLETE: run {run_dir.name} launch {r.get('n', 1)} (started {r.get('started')}) "
            f"stopped while {r.get('state')} ({pending}); the stages above are all it submitted")
    active = [f"{x.stage} job {x.job_id} ({x.state})" for x in rows if alive(x.state)]
    active += _unrecorded(run_dir, data)
    if not active:
        return f"{head}. Launch the same run_id again to reconcile and resume it."
    return (f"{head}, and {'; '.join(active)} still queued or running: a launch of this run is refused "
            f"until they end ([run_active]). Wait for them (python -m orchestrator status {run_dir}) or "
            f"cancel them (python -m orchestrator cancel {run_dir}), then launch the same run_id again to "
            "submit the rest.")


def _unrecorded(run_dir: Path, data: dict) -> list[str]:
    """The jobs a dead launch submitted without recording them (found in the queue by their comment:
    launches.LaunchRecord.orphans), still queued or running; a relaunch adopts them, then waits for them."""
    try:
        found = launches.LaunchRecord(str(run_dir), data).orphans()
    except RuntimeError as err:  # squeue cannot say: the relaunch would not know either
        return [f"its unrecorded jobs, perhaps ({err})"]
    return [f"{stage} job {jid} ({state}, submitted by launch {n} without being recorded)"
            for n, stage, jid, state in found if jid]


def moved_note(run_dir: Path) -> list[str]:
    """One line when the run was launched at another place, which no longer holds it (moved since)."""
    try:
        found = launches.moves(launches.read(run_dir), run_dir)
    except launches.RunRecordError:
        return []
    if not found:
        return []
    n, old = found[-1]
    return [f"MOVED: run {run_dir.name} was launched at {old} (launch {n}) and now stands at {run_dir}: "
            f"status and logs read it here, but a job still running writes to {old}; to launch it again "
            f"here, add run_dir={run_dir} to its overrides"]


def format_history(path: str) -> str:
    """Every launch of every run under ``path``: when, overrides, job ids, state and outcome."""
    lines = []
    for run_dir in run_dirs_of(path):
        lines.append(f"run {run_dir.name}:")
        try:
            launched = history(launches.read(run_dir))
        except launches.RunRecordError as err:
            lines.append(f"  {err}")
            continue
        for r in launched:
            jobs = " ".join(f"{s}={es[-1]['job_id']}{'(adopted)' if es[-1].get('adopted') else ''}"
                            for s, es in r.get("jobs", {}).items() if es) or "-"
            outcome = " ".join(f"{s}={st}" for s, st in (r.get("outcome") or {}).items()) or "-"
            state = INCOMPLETE if r.get("state") != INCOMPLETE and is_incomplete(r) else r.get("state")
            lines += [f"  launch {r.get('n', 1)}  {r.get('started')}  {state}  sha "
                      f"{(r.get('git') or {}).get('sha', '')}",
                      f"    overrides: {' '.join(r.get('overrides') or []) or '-'}",
                      f"    jobs: {jobs}", f"    outcome: {outcome}"]
    return "\n".join(lines)


def best_point(rows: list[JobRow]) -> list[str]:
    """A sweep's point with the highest HumanEval pass@1 (with its overrides), once two points have one."""
    scored = [r for r in rows if r.pass_at_1 is not None]
    if len(scored) < 2:
        return []
    best = max(scored, key=lambda r: r.pass_at_1)
    return ["", f"BEST pass@1: {best.pass_at_1:.4f} run {best.run} ({best.name}) of {len(scored)} evaluated"]


def rank_problems(rows: list[JobRow]) -> list[str]:
    """One line per stage that failed or was cancelled, with its reason, and per stage note (the tune
    stage's trials); per training rank that is stale,
    stalled or hung, naming its host; per checkpoint skipped at load; per op the kernel self-check refused;
    per run whose online W&B fell back to offline."""
    out = []
    for r in rows:
        out += [f"{r.state}: run {r.run} stage {r.stage} (job {r.job_id}): {r.failure}"] if r.failure else []
        out += [f"  after it: {c}" for c in r.consequences]
        out += [f"{r.stage.upper()}: run {r.run}: {r.note}"] if r.note else []
        explained = bool(r.failure)  # its failed ranks are the reason above and the lines after it
        for h in r.ranks:
            if h.state in ("ok", "exited", "interrupted") or explained and h.state == "failed":
                continue
            where = f"{h.state.upper()}: run {r.run} rank {h.rank} on {h.host} (pid {h.pid}), iteration " + (
                "-" if h.iteration is None else str(h.iteration))
            what = {"stale": f"phase {h.phase}: no heartbeat for {h.age_s:.0f} s (process stopped, killed or "
                             f"its node lost)",
                    "stalled": f"phase {h.phase}: alive, no progress for {h.idle_s:.0f} s (waiting in a "
                               f"collective?)"}
            out.append(f"{where}, {what.get(h.state, h.message or h.state)}")
        out += [f"HANG (recorded): run {r.run} {h}" for h in r.hangs]
        out += [f"BAD NODE: run {r.run}: {b}" for b in r.bad_nodes]
        out += [f"CHECKPOINT: run {r.run}: {w}" for w in r.checkpoint_warnings]
        out += [f"KERNELS: run {r.run}: {w}" for w in r.kernel_fallbacks]
        out += [f"W&B: run {r.run}: {r.wandb_offline}"] if r.wandb_offline else []
    return ([""] if out else []) + out


def plot(path: str, out: str) -> str:
    """Loss curves of every run under ``path`` on one chart (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for run_dir in run_dirs_of(path):
        recs = [(i, loss) for i, loss, _ in log_records(run_dir, TRAIN) if loss is not None]
        if recs:
            try:
                label = launches.read(run_dir).get("name") or run_dir.name
            except launches.RunRecordError:
                label = run_dir.name
            ax.plot([i for i, _ in recs], [x for _, x in recs], label=label)
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title(f"Slipway: {Path(path).name}")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
