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
same words: PENDING (reason ``Dependency``, :data:`LOCAL_PENDING_REASON`) while the process waits for its
upstream jobs, RUNNING while it exists otherwise, COMPLETED / FAILED from their results and markers (or
FAILED from the controller's record of how its tasks ended: :func:`read_exits`), CANCELLED once Slipway
cancelled it, and ENDED (failed) for a process that is gone without any of them. A zombie (ended, not yet
reaped by its parent) is gone.

A job array (layout=auto's trials) is recorded under its array id ``A``; squeue and sacct list its
elements (``A_0``, ``A_[2-3%1]``). Each element is answered under its own id, and the array under ``A``
(:func:`array_state`): alive while any element is, else failed if any failed, cancelled if any was, else
done.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
from pathlib import Path

from trainer.run_files import COMPLETE, LOCAL_EXITS
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
LOCAL_PENDING_REASON = "Dependency"  # a local job waiting for its upstream: Slurm's reason for the same
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


_GONE = ("Z", "X")  # /proc states of a process that has ended: a zombie (not yet reaped) or dead


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, session id) from ``/proc/<pid>/stat``, None when it cannot be read (no such
    process, or no /proc)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    return fields[0], int(fields[1]), int(fields[3])


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9: the name of the signal that ended a process (exit status -9, srun's "Killed")."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def process_alive(pid: int | str) -> bool:
    """Whether a local process exists and has not ended. ``kill(pid, 0)`` raising PermissionError means it
    exists and belongs to someone else; ProcessLookupError (or a pid that is no number) means it is gone.
    ``kill`` also succeeds on a zombie — a process that ended but whose parent has not collected its exit
    status yet (a job shell whose launcher is busy) — so /proc's state decides: a zombie has ended, and
    whatever waits for it (a downstream stage, the launcher, a relaunch) must not wait on."""
    try:
        pid = int(pid)
        if pid <= 0:  # kill(0 or -n, 0) asks about a whole process group
            return False
        os.kill(pid, 0)
    except PermissionError:
        pass
    except (ProcessLookupError, ValueError, OverflowError):
        return False
    stat = proc_stat(pid)
    return stat is None or stat[0] not in _GONE


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
    still exists: PENDING while it waits for its upstream jobs (:func:`_waiting`), else RUNNING."""
    folder = Path(entry.get("folder", ""))
    jid = str(entry["job_id"])
    alive = local_job_alive(jid, entry.get("folder"))  # before the files: an ended job has written them
    if cancelled and not alive:
        return "CANCELLED"
    results = list(folder.glob(f"{jid}_*_result.pkl"))
    if results:
        outcomes = {pickle.loads(r.read_bytes())[0] for r in results}
        return "FAILED" if "error" in outcomes else "COMPLETED"
    ends = read_exits(folder, jid)
    last = [e for e in ends if e.get("attempt") == ends[-1].get("attempt")] if ends else []
    if not alive and any(e.get("code") not in (0, None) for e in last):
        return "FAILED"  # a task of its last attempt ended by a signal or an exit code (the controller saw)
    state_dir = entry.get("state_dir", "")
    if marker_of(state_dir, FAILED_MARKER, jid) is not None:
        return "FAILED"
    if alive:  # waiting for its upstream jobs is Slurm's PENDING (Dependency), not RUNNING
        return "PENDING" if _waiting(entry) else "RUNNING"
    return "COMPLETED" if marker_of(state_dir, COMPLETE, jid) is not None else "ENDED"


def read_exits(folder: str | Path, job_id: str | int) -> list[dict]:
    """The task ends a local job's controller recorded (orchestrator/world/local_jobs.py ``Controller``),
    oldest first; [] when none (the job still runs every task, or an older Slipway's controller ran
    it)."""
    try:
        lines = (Path(folder) / LOCAL_EXITS.format(job=job_id)).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a full disk
        if isinstance(record, dict):
            out.append(record)
    return out


def _waiting(entry: dict) -> bool:
    """A live local job is still held by its dependencies (``waits_for``, recorded at submission: the local
    upstream jobs its callable waits for, stages/upstream.py wait_for): an afterok one has not written its
    ``_COMPLETE``, an afterany one has not ended. Slurm holds such a job PENDING (Dependency) the same way,
    including after the upstream failed (DependencyNeverSatisfied) until it is cancelled; a local one then
    fails within a second."""
    for up in entry.get("waits_for") or ():
        jid, state_dir = str(up.get("job_id")), up.get("state_dir", "")
        if marker_of(state_dir, COMPLETE, jid) is not None:
            continue
        if not up.get("after_any"):
            return True
        if marker_of(state_dir, FAILED_MARKER, jid) is None and process_alive(jid):
            return True
    return False


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
