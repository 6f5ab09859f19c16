"""Cancelling a run: every job it recorded that is still queued or running, on Slurm (one ``scancel``) and
on this machine (orchestrator/local_jobs.py: no process of the job survives). The cancelled jobs are
marked in ``run.json`` (launches.py) so ``status`` says CANCELLED, and a relaunch resumes the run from its
last complete checkpoint. Used by ``python -m orchestrator cancel RUN`` and by a waiting launch that is
interrupted (flow.py)."""

from __future__ import annotations

import subprocess
from typing import Any

from orchestrator import launches, local_jobs
from orchestrator.queue import alive, process_alive, query_slurm


def cancel_run(run_dir: str, launch_n: int | None = None, started: dict[str, Any] | None = None) -> list[str]:
    """Cancel the run's live jobs (of launch ``launch_n`` only, when given); one line per job cancelled.
    ``started``: {job id: submitit job} this process started (reaped after)."""
    data = launches.read(run_dir)
    entries = [(n, stage, e) for n, stage, e in launches.all_jobs(data) if launch_n in (None, n)]
    slurm = {str(e["job_id"]): (n, stage) for n, stage, e in entries if e.get("executor", "slurm") == "slurm"}
    squeue, _ = query_slurm(list(slurm))
    live = [j for j in slurm if j in squeue and alive(squeue[j][0])]
    lines, done = [], {}
    if live:
        res = subprocess.run(["scancel", *live], capture_output=True, text=True, timeout=60)
        if res.returncode != 0:
            lines.append(f"scancel {' '.join(live)} failed: {res.stderr.strip()}")
        else:
            for j in live:
                lines.append(f"{slurm[j][1]} job {j} cancelled (scancel)")
                done.setdefault(slurm[j][0], []).append(j)
    for n, stage, e in entries:
        jid = str(e["job_id"])
        if e.get("executor") != "local" or not process_alive(jid):
            continue
        pids = local_jobs.cancel(jid, str(e.get("folder", "")), job=(started or {}).get(jid))
        if pids:
            lines.append(f"{stage} job {jid} cancelled ({len(pids)} process(es) ended)")
            done.setdefault(n, []).append(jid)
    launches.mark_cancelled(run_dir, done)
    return lines
