"""A run's launch history in ``run.json``: one record per launch, appended, never rewritten by a later one.

``run.json`` holds the run's identity (``run_id``, ``experiment``, ``name``, ``created``) and
``launches``: every launch of the run, oldest first, each with when it started, the overrides it was given,
its git state, resolved config (also written to ``launches/<n>/config.yaml``; ``config.yaml`` at the top is
a link to the latest one), stage keys, scripts, job ids and its outcome. A launch writes only its own
record; the next launch adds the earlier one's final job states (``outcome``) when it starts, and a
submission the earlier one left unrecorded (below), and ``cancel`` the ids of the jobs it cancelled
(``cancelled``), never anything else of it.

Submission is crash-consistent. Each launch moves through ``state``:

- ``recording``: the record exists, nothing submitted yet;
- ``submitting``: before each ``sbatch`` an intent is recorded under ``pending`` (the stage and the job's
  ``--comment``, :func:`job_comment`), and after it the job id under ``jobs`` (the intent goes);
- ``submitted``: every stage was submitted or reused.

A launch whose process died before ``submitted`` is *incomplete* (``status`` says so). The next launch
reconciles it first (:meth:`LaunchRecord.reconcile`): every pending intent is looked up in the queue by
its comment (queue.py); a job found is recorded as ``adopted`` in the dead launch's ``jobs``, where the
one-writer check (writer_lock.py) sees it and refuses while it is alive, naming its id. Nothing is ever
submitted twice for one intent, and no submitted job goes unrecorded. A launch reads ``run.json`` once,
under its lock, and passes that :class:`LaunchRecord` down.

The previous format (one launch, its ``config``/``jobs``/``stages``/``scripts`` at the top level) reads as
a history of one launch; a relaunch converts it.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.world.runs import read_json, write_json
from trainer.run_files import CONFIG, RUN_JSON, RunDir

FORMAT = 2
# CONFIG (run_files): the resolved config: launches/<n>/config.yaml; the top-level one links the latest
RECORDING, SUBMITTING, SUBMITTED = "recording", "submitting", "submitted"
INCOMPLETE = "incomplete"  # what status calls a launch that stopped before SUBMITTED
# Fields of a previous-format run.json that belong to its one launch.
_LAUNCH_FIELDS = ("git", "config", "stages", "sweep", "scripts", "jobs")
_IDENTITY = ("run_id", "experiment", "name", "created")


def history(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Every launch recorded in a run.json (either format), oldest first."""
    if "launches" in data:
        return list(data["launches"])
    if any(k in data for k in _LAUNCH_FIELDS):
        one = {k: data[k] for k in _LAUNCH_FIELDS if k in data}
        return [{"n": 1, "started": data.get("created"), "state": SUBMITTED, **one}]
    return []


def current(data: dict[str, Any]) -> dict[str, Any]:
    """The latest launch's record ({} when none)."""
    runs = history(data)
    return runs[-1] if runs else {}


def current_jobs(data: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """{stage: [job entries]} of the latest launch: the jobs ``status`` shows."""
    return current(data).get("jobs", {})


def all_jobs(data: dict[str, Any]) -> list[tuple[int, str, dict[str, Any]]]:
    """(launch number, stage, entry) of every job any launch of the run recorded."""
    return [(r.get("n", i + 1), stage, e) for i, r in enumerate(history(data))
            for stage, entries in r.get("jobs", {}).items() for e in entries]


def recorded_dir(record: dict[str, Any]) -> str | None:
    """Where the run directory stood when launch ``record`` ran: its ``run_dir``, or for a record from
    before launches kept it, read off a job of the run's own (not a shared stage's, which lives in the
    cache): its submitit folder ``RunDir.jobs(stage)`` and state folder ``RunDir.stage_state(stage)``."""
    if record.get("run_dir"):
        return str(record["run_dir"])
    for stage, entries in record.get("jobs", {}).items():
        for e in entries:
            folder = Path(e.get("folder") or "/")
            root = RunDir(folder.parents[1]) if len(folder.parts) > 2 else None
            state = Path(e.get("state_dir") or "/")
            if root and root.jobs(stage) == folder and root.stage_state(stage) == state:
                return str(root.root)
    return None


def _moved(value: Any, old: str, new: str) -> Any:
    if isinstance(value, str) and (value == old or value.startswith(old + os.sep)):
        return new + value[len(old):]
    if isinstance(value, dict):
        return {k: _moved(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_moved(v, old, new) for v in value]
    return value


def moves(data: dict[str, Any], run_dir: str | Path) -> list[tuple[int, str]]:
    """(launch, where it ran) of every launch recorded at another place than ``run_dir``, which no longer
    holds the run there: the run directory was moved (``mv``) since (a copy leaves the original in place:
    its jobs wrote there, and that is where they are read)."""
    here, out = os.path.abspath(run_dir), []
    for i, r in enumerate(history(data)):
        old = recorded_dir(r)  # as recorded: relative to the launch's folder when runs_root was relative
        if old and os.path.abspath(old) != here and not (Path(old) / RUN_JSON).exists():
            out.append((r.get("n", i + 1), old.rstrip(os.sep)))
    return out


def relocated(data: dict[str, Any], run_dir: str | Path) -> dict[str, Any]:
    """``data`` as readers need it after the run directory was moved (:func:`moves`): every path a launch
    recorded under its old place (job folders, state and log folders, its config's) under ``run_dir``.
    Shared stages' folders outside the run directory stay as recorded. The record on disk is never
    rewritten (a launch writes only its own record)."""
    found = dict(moves(data, run_dir))
    if not found:
        return data
    here = os.path.abspath(run_dir)
    runs = [_moved(r, found[r.get("n", i + 1)], here) if r.get("n", i + 1) in found else r
            for i, r in enumerate(history(data))]
    return {**_upgraded(data), "launches": runs}


def launch_dir(run_dir: str, n: int) -> Path:
    return RunDir(run_dir).launch(n)


def job_comment(run_dir: str, n: int, stage: str) -> str:
    """The ``--comment`` that names a job's run (a digest of its absolute run directory), launch and stage:
    how a relaunch finds a job that a dead launch submitted but did not record."""
    digest = hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:16]
    return f"slipway:{digest}:{n}:{stage}"


class RunRecordError(ValueError):
    """``run.json`` cannot be read as a run record (truncated, hand-edited, not a file); the message names
    it and says how to recover."""

    def __init__(self, path: Path, why: str) -> None:
        self.path = path
        super().__init__(
            f"{path} is not a readable run record ({why}). Move it aside (mv {path} {path}.broken) and "
            f"launch the same run_id again: the run resumes from its checkpoints, and every earlier "
            f"launch's config and job scripts stay in {RunDir(path.parent).launches}/<n>/; first make sure "
            "no job of the run is still queued or running (squeue --me; ps), since their ids were in it")


def read(run_dir: str | Path) -> dict[str, Any]:
    """The run's record ({} when it has none yet). Raises :class:`RunRecordError` when it is unreadable: a
    launch must not take a damaged record for an empty one (it would forget the run's live jobs)."""
    path = Path(run_dir) / RUN_JSON
    try:
        data = read_json(path)
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as err:
        raise RunRecordError(path, f"{type(err).__name__}: {err}") from err
    except ValueError as err:
        raise RunRecordError(path, f"not valid JSON: {err}") from err
    if not isinstance(data, dict) or not isinstance(data.get("launches", []), list):
        raise RunRecordError(path, "not a JSON object with a list of launches")
    return data


def _upgraded(data: dict[str, Any]) -> dict[str, Any]:
    """A run.json in this format (a previous-format one becomes identity + one launch)."""
    if "launches" in data:
        return data
    out = {k: data[k] for k in data if k not in _LAUNCH_FIELDS}
    out["launches"] = history(data)
    return out


@dataclass
class LaunchRecord:
    """The run's ``run.json`` read once: a launch loads it under its lock (writer_lock.single_writer) and
    passes it down. Every change is written through at once: crash consistency needs each intent on disk
    before its ``sbatch``. A launch writes only its own record (and settles dead ones: :meth:`reconcile`)."""

    run_dir: str
    data: dict[str, Any]
    n: int | None = None  # this launch's number, once begun

    @classmethod
    def load(cls, run_dir: str | Path) -> LaunchRecord:
        return cls(str(run_dir), _upgraded(read(run_dir)))

    def next_launch(self) -> int:
        """The number the run's next launch gets."""
        return len(self.data["launches"]) + 1

    def _save(self) -> None:
        write_json(Path(self.run_dir) / RUN_JSON, self.data)

    def begin(self, identity: dict[str, Any], record: dict[str, Any]) -> int:
        """Append a new launch (state ``recording``); returns its number. Called under the run's launch
        lock. Identity fields already recorded (the first launch's) are kept."""
        for key in _IDENTITY:
            if key in identity:
                self.data.setdefault(key, identity[key])
        self.data["format"] = FORMAT
        n = self.n = self.next_launch()
        self.data["launches"].append({"n": n, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                      "state": RECORDING, "host": socket.gethostname(), "pid": os.getpid(),
                                      **record, "jobs": {}, "pending": {}})
        self._save()
        return n

    def update(self, n: int, change) -> None:
        """Apply ``change`` to launch ``n``'s record only (a launch writes nothing of another's)."""
        change(self.data["launches"][n - 1])
        self._save()

    def set_state(self, n: int, state: str) -> None:
        self.update(n, lambda r: r.update(state=state))

    def record_intent(self, n: int, stage: str, comment: str) -> None:
        """Before ``sbatch``: the stage about to be submitted and the comment its job will carry."""
        def change(r: dict[str, Any]) -> None:
            r["state"] = SUBMITTING
            at = time.strftime("%Y-%m-%dT%H:%M:%S")
            r.setdefault("pending", {})[stage] = {"comment": comment, "at": at}
        self.update(n, change)

    def record_job(self, n: int, stage: str, entry: dict[str, Any]) -> None:
        """After ``sbatch``: the job id (and folder, dependency, key) replaces the stage's intent."""
        def change(r: dict[str, Any]) -> None:
            r.setdefault("jobs", {}).setdefault(stage, []).append(entry)
            r.get("pending", {}).pop(stage, None)
        self.update(n, change)

    def mark_cancelled(self, jobs: dict[int, list[str]]) -> None:
        """Record that Slipway cancelled these jobs ({launch: [job ids]}) in their launches' ``cancelled``
        lists (the job entries stay as submitted): a local job's process leaves no other trace of why it
        ended."""
        for r in self.data["launches"]:
            if jobs.get(r.get("n")):
                r["cancelled"] = sorted({*r.get("cancelled", ()), *map(str, jobs[r["n"]])})
        self._save()

    def add_outcomes(self, states: dict[str, str]) -> None:
        """Record the final states of earlier launches' jobs ({job id: state}, ended jobs only) in their
        ``outcome`` ({stage: state}), once: a relaunch keeps what the earlier launch produced."""
        changed = False
        for r in self.data["launches"]:
            got = {stage: states[str(es[-1]["job_id"])] for stage, es in r.get("jobs", {}).items()
                   if es and str(es[-1]["job_id"]) in states}
            if not r.get("outcome") and got and len(got) == len(r.get("jobs", {})):
                r["outcome"], changed = got, True
        if changed:
            self._save()

    def orphans(self, find=None) -> list[tuple[int, str, str | None, str]]:
        """(launch, stage, job id or None, state) for every intent a dead launch left pending: its job as
        the queue knows it by comment (None: not queued or running). Reads only."""
        from orchestrator.world.queue import jobs_by_comment

        wanted = [(r["n"], stage, p["comment"]) for r in _stale(self.data)
                  for stage, p in r.get("pending", {}).items()]
        if not wanted:
            return []
        # a local job has no comment (and no queue to ask): its intent is settled as not found
        comments = [c for _, _, c in wanted if c]
        found = (find or jobs_by_comment)(comments) if comments else {}
        return [(n, stage, *((c and found.get(c)) or (None, ""))) for n, stage, c in wanted]

    def reconcile(self, find=None) -> list[str]:
        """Settle every incomplete launch of the run: each pending intent's job found in the queue is
        recorded (``adopted``) in that launch's ``jobs``; the launch is marked ``incomplete``. Returns one
        line per intent settled. Called under the run's launch lock, before the one-writer check."""
        lines = []
        for n, stage, job_id, state in self.orphans(find):
            if job_id:
                self.record_job(n, stage, {"job_id": job_id, "executor": "slurm", "adopted": True,
                                           "comment": job_comment(self.run_dir, n, stage)})
                lines.append(f"launch {n} died after submitting {stage} as job {job_id} ({state}) without "
                             "recording it: recorded now")
            else:
                self.update(n, lambda r, s=stage: r["pending"].pop(s, None))
                lines.append(f"launch {n} died before recording its {stage} job, and no job of it is queued "
                             "or running (never submitted, or already ended)")
        for r in _stale(self.data):
            self.update(r["n"], lambda x: x.update(state=INCOMPLETE))
        return lines


def cancelled_ids(data: dict[str, Any]) -> set[str]:
    """The ids of every job Slipway cancelled, in any launch of the run."""
    return {str(j) for r in history(data) for j in r.get("cancelled", ())}


def is_incomplete(record: dict[str, Any]) -> bool:
    """A launch that stopped before it submitted everything (its process is gone)."""
    from orchestrator.world.queue import process_alive

    if record.get("state", SUBMITTED) == SUBMITTED:
        return False
    here = record.get("host") == socket.gethostname()
    return not (here and record.get("pid") and process_alive(record["pid"]))


def _stale(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in history(data) if r.get("state") != INCOMPLETE and is_incomplete(r)]


def link_config(run_dir: str, n: int) -> Path:
    """``launches/<n>/config.yaml``'s path; the top-level ``config.yaml`` becomes a link to it. A
    previous-format run's ``config.yaml`` (its one launch's) moves to ``launches/001`` first."""
    top, first = Path(run_dir) / CONFIG, launch_dir(run_dir, 1) / CONFIG
    if top.is_file() and not top.is_symlink() and not first.exists():
        first.parent.mkdir(parents=True, exist_ok=True)
        os.replace(top, first)
    path = launch_dir(run_dir, n) / CONFIG
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = top.with_name(f".{CONFIG}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(path.relative_to(run_dir))
    os.replace(tmp, top)
    return path
