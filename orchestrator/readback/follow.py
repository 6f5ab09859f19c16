"""Live output of a local run: each stage's rank-0 log, streamed to the terminal as the job writes it.

Local jobs (submitit's LocalExecutor) write their stdout/stderr to ``<folder>/<job id>_<task>_log.{out,err}``;
without this, ``make demo`` would sit silent for minutes. Only task 0's stderr is followed (the trainer logs
on every rank, the others repeat it); the other ranks' logs stay on disk and the failed stage's are
printed by :func:`failure_tails`. Text is forwarded up to the last line end or carriage return, so a tqdm
bar written to the log (the preprocess stage draws one on local runs) redraws in place on a terminal.

What a failure adds to the terminal is its cause, once: a traceback is shown as its exception line alone
(:class:`Condenser`; the whole traceback stays in the log, whose path the stage's header names), and a
stage that did not run because its upstream failed (stages/upstream.py ``NOT_RUN``) is not streamed: the
launcher's state line for it says so, in one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from orchestrator.record.launches import current_jobs
from orchestrator.world.queue import marker_of
from orchestrator.world.runs import read_json
from trainer.run_files import FAILED, RUN_JSON, SUBMITIT_LOG

TRACEBACK = "Traceback (most recent call last):"
# Python's lines between the tracebacks of a chained exception, and submitit's line before a job's.
_CHAIN = ("During handling of the above exception, another exception occurred:",
          "The above exception was the direct cause of the following exception:")
_SUBMITIT_RAISED = "Submitted job triggered an exception"


class Condenser:
    """A log's text with every traceback reduced to its exception line (and a chained exception's to
    each of its exception lines), fed in complete lines; the rest passes unchanged. Blank lines after an
    exception line are held until the next line says whether a chained traceback follows."""

    def __init__(self) -> None:
        self.inside = False  # in a traceback's frames
        self.held: list[str] = []  # blank lines after an exception line

    def lines(self, text: str) -> str:
        out = []
        for line in text.splitlines(keepends=True):
            bare = line.rstrip("\r\n")
            if self.inside and (bare.startswith((" ", "\t")) or not bare):
                continue  # a frame, its source line, carets
            if self.held and not bare:
                self.held.append(line)
                continue
            if bare == TRACEBACK:
                self.inside, self.held = True, []
                continue
            if bare in _CHAIN or bare.endswith(_SUBMITIT_RAISED):
                self.held = [""] if bare in _CHAIN else self.held  # a traceback follows, after a blank
                continue
            out += self.held
            self.held = []
            if self.inside:  # the exception line: blank lines after it may lead to a chained one
                self.inside, self.held = False, [""]
            out.append(line)
        return "".join(out)


def condensed(text: str) -> str:
    return Condenser().lines(text)


def not_run(state_dir: str, job_id: str) -> bool:
    """Whether the job's stage did not run because its upstream failed (its marker says so)."""
    return bool((marker_of(state_dir, FAILED, job_id) or {}).get("not_run"))


def log_path(folder: str, job_id: str, task: int = 0, stream: str = "err") -> Path:
    """Where submitit's LocalExecutor (and SlurmExecutor) put a task's stdout/stderr."""
    return Path(folder) / SUBMITIT_LOG.format(job=job_id, task=task, stream=stream)


@dataclass
class LogFollower:
    """Forwards new text of every local stage's task-0 stderr under ``run_dir`` to ``out`` on each poll."""

    run_dir: str
    out: TextIO
    offsets: dict[str, int] = field(default_factory=dict)  # log path → bytes already forwarded
    started: set[str] = field(default_factory=set)  # stages whose header was printed
    condensers: dict[str, Condenser] = field(default_factory=dict)  # log path → its traceback state

    def _local_jobs(self) -> list[tuple[str, dict]]:
        try:
            jobs = current_jobs(read_json(Path(self.run_dir) / RUN_JSON))
        except (OSError, ValueError):  # being rewritten: next poll
            return []
        return [(stage, es[-1]) for stage, es in jobs.items() if es and es[-1].get("executor") == "local"]

    def poll(self) -> None:
        for stage, entry in self._local_jobs():
            path = log_path(entry.get("folder", ""), str(entry["job_id"]))
            key = str(path)
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets.get(key, 0))
                    chunk = f.read()
            except OSError:
                continue  # not started yet
            end = max(chunk.rfind(b"\n"), chunk.rfind(b"\r")) + 1
            if end == 0:
                continue  # no complete line (or bar update) yet
            self.offsets[key] = self.offsets.get(key, 0) + end
            if stage not in self.started and not_run(entry.get("state_dir", ""), str(entry["job_id"])):
                continue  # its one line is the launcher's state line (stages/base.py writes the marker first)
            text = self.condensers.setdefault(key, Condenser()).lines(chunk[:end].decode("utf-8",
                                                                                           errors="replace"))
            if not text:
                continue
            if stage not in self.started:
                self.started.add(stage)
                self.out.write(f"──── {stage} (job {entry['job_id']}, log {path}) ────\n")
            self.out.write(text)
            self.out.flush()


def failure_tails(run_dir: str, stages: list[str], lines: int = 15, streamed: frozenset[str] = frozenset()
                  ) -> str:
    """The last ``lines`` lines of every task's stderr of the given local stages (what went wrong),
    tracebacks condensed, except the logs already ``streamed`` to the terminal (their paths) and the
    stages that did not run (their state line said so)."""
    jobs = current_jobs(read_json(Path(run_dir) / RUN_JSON))
    parts = []
    for stage in stages:
        entry = (jobs.get(stage) or [{}])[-1]
        if not entry.get("folder") or not_run(entry.get("state_dir", ""), str(entry["job_id"])):
            continue
        logs = SUBMITIT_LOG.format(job=entry["job_id"], task="*", stream="err")
        for path in sorted(Path(entry["folder"]).glob(logs)):
            if str(path) in streamed:
                continue
            text = condensed(path.read_text(errors="replace").replace("\r", "\n")).splitlines()
            if text:
                parts.append(f"──── {stage}: last lines of {path} ────")
                parts += text[-lines:]
    return "\n".join(parts) + ("\n" if parts else "")
