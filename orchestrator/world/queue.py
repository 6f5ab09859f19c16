"""Every question to the queue, and the one job-state vocabulary: is a job pending, running or ended?

Slurm's job states (``squeue -o %T``, ``sacct -o State``) are mapped here, once, to five categories:
``pending`` and ``running`` (the job is alive: it may still write its outputs), ``done``, ``failed`` and
``cancelled`` (it ended). Everything that decides whether a job is still alive — reusing a queued shared
stage (submit), refusing a second writer of a run (writer_lock), a blocking launch's wait (flow), the
status table, the tests' waits — asks :func:`category` or :func:`alive` instead of keeping its own list.

States Slurm may requeue:

- ``REQUEUED``, ``REQUEUE_HOLD``, ``REQUEUE_FED``, ``SPECIAL_EXIT``, ``RESV_DEL_HOLD`` are *pending*: the
  job keeps its id and runs again (after a release, for the held ones), so a launch must not start a
  second writer and a wait must not report it ended.
- ``PREEMPTED`` and ``NODE_FAIL`` are *failed*: they are Slurm's terminal states for that run of the job.
  When the job requeues (``--requeue``, PreemptMode=REQUEUE), its state moves on to REQUEUED/PENDING, and
  squeue — which this module asks first — reports that. Only accounting alone (slurmctld unreachable) can
  lag and still read NODE_FAIL for a requeued job; the status table says when its states come from there.
- A state this module does not know (a newer Slurm's, ``UNKNOWN`` before accounting has the job, a
  garbled line) counts as *pending*: treating an unknown job as ended could let a second launch write the
  same checkpoints, while the opposite only makes a wait or a refusal last longer.

Local jobs (submitit's LocalExecutor) are processes of this machine; their ids are pids. They report the
same words: RUNNING while the process exists, COMPLETED / FAILED from their results and markers, and
ENDED (failed) for a process that is gone without either.

A job array (layout=auto's trials) is recorded under its array id ``A``; squeue and sacct list its
elements (``A_0``, ``A_[2-3%1]``). Each element is answered under its own id, and the array under ``A``
(:func:`array_state`): alive while any element is, else failed if any failed, cancelled if any was, else
done.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
from pathlib import Path

from trainer.run_files import COMPLETE
from trainer.run_files import FAILED as FAILED_MARKER

PENDING, RUNNING, DONE, FAILED, CANCELLED = "pending", "running", "done", "failed", "cancelled"
CATEGORIES = (PENDING, RUNNING, DONE, FAILED, CANCELLED)

# Every state string Slurm reports (slurm/src/common/slurm_protocol_defs.c job_state_string), and the
# words local jobs use. Flags such as CONFIGURING or COMPLETING are shown instead of the base state they
# modify; they are placed by what the job can still do.
_CATEGORY = {
    "PENDING": PENDING,
    "REQUEUED": PENDING,  # being put back in the queue; it runs again under the same id
    "REQUEUE_FED": PENDING,
    "REQUEUE_HOLD": PENDING,  # requeued and held until released (scontrol release)
    "RESV_DEL_HOLD": PENDING,  # held because its reservation was deleted
    "SPECIAL_EXIT": PENDING,  # requeued in a held "special exit" state (set by an epilog)
    "RUNNING": RUNNING,
    "CONFIGURING": RUNNING,  # allocated, nodes booting: the batch script starts next
    "COMPLETING": RUNNING,  # processes or the epilog still ending: they may still write
    "RESIZING": RUNNING,
    "SIGNALING": RUNNING,  # being signalled (e.g. the time-limit USR2): it checkpoints now
    "STAGE_OUT": RUNNING,  # burst-buffer stage-out after the script
    "STOPPED": RUNNING,  # SIGSTOPped, allocation kept: it continues on SIGCONT
    "SUSPENDED": RUNNING,  # suspended (scontrol suspend / gang scheduling): it resumes and writes again
    "COMPLETED": DONE,
    "FAILED": FAILED,
    "BOOT_FAIL": FAILED,
    "DEADLINE": FAILED,
    "NODE_FAIL": FAILED,  # terminal for this run; a requeue shows as REQUEUED/PENDING (docstring)
    "OUT_OF_MEMORY": FAILED,
    "PREEMPTED": FAILED,  # likewise
    "TIMEOUT": FAILED,
    "ENDED": FAILED,  # local: the process is gone without a result or a completion marker
    "CANCELLED": CANCELLED,
    "REVOKED": CANCELLED,  # federation: this cluster's sibling withdrawn (it runs elsewhere, not here)
}
UNKNOWN_CATEGORY = PENDING  # see the docstring: an unknown job is never taken for ended
STATES = frozenset(_CATEGORY)
ACTIVE = frozenset(s for s, c in _CATEGORY.items() if c in (PENDING, RUNNING))
ENDED = STATES - ACTIVE


def normalize(state: str) -> str:
    """The bare state: sacct writes ``CANCELLED by 123``, and ``CANCELLED+`` where a column is cut."""
    words = state.strip().split()
    return words[0].rstrip("+").upper() if words else ""


def category(state: str) -> str:
    """One of :data:`CATEGORIES` for any state string (unknown ones: :data:`UNKNOWN_CATEGORY`)."""
    return _CATEGORY.get(normalize(state), UNKNOWN_CATEGORY)


def alive(state: str) -> bool:
    """Queued or running: the job may still write its outputs."""
    return category(state) in (PENDING, RUNNING)


def ended(state: str) -> bool:
    return not alive(state)


def succeeded(state: str) -> bool:
    return category(state) == DONE


def process_alive(pid: int | str) -> bool:
    """Whether a local process exists. ``kill(pid, 0)`` raising PermissionError means it exists and
    belongs to someone else, so it is alive; only ProcessLookupError (or a pid that is no number) is
    gone."""
    try:
        os.kill(int(pid), 0)
    except PermissionError:
        return True
    except (ProcessLookupError, ValueError, OverflowError):
        return False
    return True


def _run(cmd: list[str]) -> tuple[str | None, str]:
    """(stdout, "") or (None, why it failed)."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{cmd[0]}: {type(e).__name__}: {e}"
    if r.returncode != 0:
        return None, f"{cmd[0]} exited {r.returncode}: {r.stderr.strip()[-300:]}"
    return r.stdout, ""


def local_job_alive(job_id: int | str, folder: str | None = None) -> bool:
    """A local job still runs: its controller's pid exists and, when the job's submitit folder is known,
    that process's command line names it. Pids are reused (pid_max is 32768 on many machines), so an old
    run's job id may belong to another program by now: that must not keep the run "active" forever."""
    if not process_alive(job_id):
        return False
    if not folder:
        return True
    try:
        command = Path(f"/proc/{int(job_id)}/cmdline").read_bytes().decode(errors="replace")
    except (OSError, ValueError):
        return True  # it exists but cannot be read (another user's): take it for alive
    return os.path.normpath(folder) in command


def controller_unreachable() -> str:
    """Why the Slurm controller does not answer ("" when it does): one cheap ``sinfo`` call."""
    out, why = _run(["sinfo", "-h", "-o", "%P"])
    return "" if out is not None else why


def live_state(job_id: str, executor: str, folder: str | None = None) -> str | None:
    """The job's state while it is alive, None once it ended or the queue no longer knows it.

    Slurm: squeue's answer; squeue exiting non-zero means the id is unknown (purged after it ended).
    When squeue cannot be run or times out, "UNKNOWN": the job may still write. Local: its process
    (:func:`local_job_alive`, checked against the job's submitit ``folder`` when given)."""
    if executor == "local":
        return "RUNNING" if local_job_alive(job_id, folder) else None
    try:
        out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "UNKNOWN"
    states = out.stdout.split()  # a job array: one line per element (or group of pending ones)
    state = next((s for s in states if alive(s)), None)
    return state if out.returncode == 0 else None


def array_of(job_id: str) -> str | None:
    """The array id of an array element's id (``123_4``, ``123_[5-7%2]``), None for any other job."""
    head, sep, tail = job_id.partition("_")
    return head if sep and head.isdigit() and tail else None


def array_state(states: list[str]) -> str:
    """One state for a whole job array from its elements' (module docstring)."""
    for wanted in (RUNNING, PENDING, FAILED, CANCELLED):
        found = next((s for s in states if category(s) == wanted), None)
        if found is not None:
            return found
    return states[0] if states else "UNKNOWN"


def parse_squeue(text: str) -> dict[str, tuple[str, str]]:
    """``squeue -h -o %i|%T|%r`` → {job id: (state, reason)}; an array also under its array id."""
    out, arrays = {}, {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 3:
            out[parts[0]] = (parts[1], parts[2] if parts[2] not in ("None", "(null)") else "")
            if (array := array_of(parts[0])) is not None:
                arrays.setdefault(array, []).append(out[parts[0]])
    for array, elements in arrays.items():
        state = array_state([s for s, _ in elements])
        out[array] = next(e for e in elements if e[0] == state)
    return out


def parse_sacct(text: str) -> dict[str, dict[str, str]]:
    """``sacct -n -P -X -o JobIDRaw,State,ExitCode,NodeList,Reason,JobID`` → {job id: fields} (last record
    wins: with --duplicates a requeued job lists its earlier runs first). An array element (JobID
    ``A_i``) is also answered under ``A_i``, and the array under ``A`` (:func:`array_state`)."""
    out: dict[str, dict[str, str]] = {}
    arrays: dict[str, list[str]] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 4 and parts[0]:
            records = int(out.get(parts[0], {}).get("records", "0")) + 1  # one per run of a requeued job
            out[parts[0]] = {
                "state": normalize(parts[1]),  # "CANCELLED by 0" → CANCELLED
                "exit": parts[2],
                "nodes": parts[3],
                "reason": parts[4] if len(parts) > 4 else "",
                "records": str(records),
            }
            name = parts[5] if len(parts) > 5 else ""
            if (array := array_of(name)) is not None:
                out[name] = out[parts[0]]
                arrays.setdefault(array, []).append(name)
    for array, names in arrays.items():
        state = array_state([out[n]["state"] for n in names])
        out[array] = {**next(out[n] for n in names if out[n]["state"] == state), "records": "1"}
    return out


def query_slurm(job_ids: list[str]) -> tuple[dict[str, tuple[str, str]], dict[str, dict[str, str]]]:
    """One squeue and one sacct call for all the ids (an empty dict where a command is unavailable)."""
    sq, sa, _ = query_slurm_checked(job_ids)
    return sq, sa


# What squeue says (exiting 1) when asked about one job id that slurmctld does not hold: a job that ended
# and was purged (MinJobAge after it ended), or an id it never had. Asked about several ids, it lists the
# ones it holds and exits 0. Either way slurmctld answered: none of the missing jobs is queued or running.
SQUEUE_UNKNOWN_ID = "Invalid job id specified"


def query_slurm_checked(job_ids: list[str]) -> tuple[dict, dict, str]:
    """Like :func:`query_slurm`, plus why squeue failed ("" when it answered): then slurmctld is
    unreachable and live states come from accounting (sacct), which may be stale. A job squeue answers it
    does not hold is no failure (:data:`SQUEUE_UNKNOWN_ID`): it ended (:func:`forgotten_state`).
    ``--duplicates``: every run of a requeued job is a record, so Slurm's own requeues (a NODE_FAIL) count
    as restarts. (submitit's watcher calls sacct per job, which overloads slurmctld at scale.)"""
    if not job_ids:
        return {}, {}, ""
    ids = ",".join(sorted(set(job_ids)))
    out, squeue_error = _run(["squeue", "-h", "-j", ids, "-o", "%i|%T|%r"])
    if out is None and SQUEUE_UNKNOWN_ID in squeue_error:
        out, squeue_error = "", ""  # slurmctld holds none of them
    sq = parse_squeue(out) if out is not None else {}
    fields = "JobIDRaw,State,ExitCode,NodeList,Reason,JobID"
    out, _ = _run(["sacct", "-n", "-P", "-X", "-D", "-j", ids, "-o", fields])
    return sq, parse_sacct(out) if out is not None else {}, squeue_error


def marker_of(state_dir: str | Path, name: str, job_id: str | None) -> dict | None:
    """A stage's ``_COMPLETE``/``_FAILED`` marker (its JSON record) when job ``job_id`` wrote it; any job's
    when ``job_id`` is None (a reused output, content-addressed by its directory). A marker an earlier job
    left (a relaunch's, or a previous attempt's) is not this job's outcome: Slurm's ``afterok`` waits for
    the job it names, and so does everything that reads markers (the local wait, status). Markers written
    before they named their job count for any job."""
    path = Path(state_dir) / name
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        record = {}  # being replaced (markers are written by rename) or damaged: it exists, nobody's
    if not isinstance(record, dict):
        record = {}
    wrote = record.get("job")
    return record if job_id is None or wrote is None or str(wrote) == str(job_id) else None


def forgotten_state(entry: dict) -> str:
    """A Slurm job that neither squeue (which answered) nor accounting knows: it ended, and slurmctld
    purged it (accounting off, or its records purged too). How it ended is what its stage's markers of
    this job say; ENDED (failed) without one."""
    state_dir, jid = entry.get("state_dir", ""), str(entry["job_id"])
    if marker_of(state_dir, FAILED_MARKER, jid) is not None:
        return "FAILED"
    return "COMPLETED" if marker_of(state_dir, COMPLETE, jid) is not None else "ENDED"


def local_state(entry: dict, cancelled: bool = False) -> str:
    """A local job's state from its run.json entry: cancelled (by Slipway, as run.json records), its
    submitit results, then the stage's markers that this job wrote, then whether the controller process
    still exists."""
    folder = Path(entry.get("folder", ""))
    jid = str(entry["job_id"])
    alive = local_job_alive(jid, entry.get("folder"))  # before the files: an ended job has written them
    if cancelled and not alive:
        return "CANCELLED"
    results = list(folder.glob(f"{jid}_*_result.pkl"))
    if results:
        outcomes = {pickle.loads(r.read_bytes())[0] for r in results}
        return "FAILED" if "error" in outcomes else "COMPLETED"
    state_dir = entry.get("state_dir", "")
    if marker_of(state_dir, FAILED_MARKER, jid) is not None:
        return "FAILED"
    if alive:
        return "RUNNING"
    return "COMPLETED" if marker_of(state_dir, COMPLETE, jid) is not None else "ENDED"


def jobs_by_comment(comments: list[str]) -> dict[str, tuple[str, str]]:
    """{comment: (job id, state)} of the queued or running jobs carrying one of these ``--comment``s (one
    squeue call; squeue shows a job's comment without accounting). A dead launch's job is found this way
    (orchestrator/record/launches.py). Raises RuntimeError when squeue cannot answer: a relaunch mustn't guess
    that nothing is queued."""
    if not comments:
        return {}
    out, why = _run(["squeue", "-h", "-o", "%i|%T|%k"])
    if out is None:
        raise RuntimeError(f"cannot ask the queue for this run's unrecorded jobs ({why}); launch again when "
                           "squeue answers")
    wanted, found = set(comments), {}
    for line in out.splitlines():
        parts = line.strip().split("|", 2)
        if len(parts) == 3 and parts[2] in wanted and alive(parts[1]):
            found[parts[2]] = (array_of(parts[0]) or parts[0], parts[1])
    return found
