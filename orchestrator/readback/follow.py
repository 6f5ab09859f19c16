"""Live output of a local run: each stage's rank-0 log, streamed to the terminal as the job writes it.

Local jobs (submitit's LocalExecutor) write their stdout/stderr to ``<folder>/<job id>_<task>_log.{out,err}``;
without this, ``make demo`` would sit silent for minutes. Only task 0's stderr is followed (the trainer logs
on every rank, the others repeat it); the other ranks' logs stay on disk and a failed stage's tails are
printed by :func:`failure_tails`. Text is forwarded up to the last line end or carriage return, so a tqdm
bar written to the log (the preprocess stage draws one on local runs) redraws in place on a terminal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from orchestrator.record.launches import current_jobs
from orchestrator.world.runs import read_json
from trainer.run_files import RUN_JSON, SUBMITIT_LOG


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
            if stage not in self.started:
                self.started.add(stage)
                self.out.write(f"──── {stage} (job {entry['job_id']}, log {path}) ────\n")
            self.offsets[key] = self.offsets.get(key, 0) + end
            self.out.write(chunk[:end].decode("utf-8", errors="replace"))
            self.out.flush()


def failure_tails(run_dir: str, stages: list[str], lines: int = 15) -> str:
    """The last ``lines`` lines of every task's stderr of the given local stages (what went wrong)."""
    jobs = current_jobs(read_json(Path(run_dir) / RUN_JSON))
    parts = []
    for stage in stages:
        entry = (jobs.get(stage) or [{}])[-1]
        if not entry.get("folder"):
            continue
        logs = SUBMITIT_LOG.format(job=entry["job_id"], task="*", stream="err")
        for path in sorted(Path(entry["folder"]).glob(logs)):
            text = path.read_text(errors="replace").replace("\r", "\n").splitlines()
            if text:
                parts.append(f"──── {stage}: last lines of {path} ────")
                parts += text[-lines:]
    return "\n".join(parts) + ("\n" if parts else "")
