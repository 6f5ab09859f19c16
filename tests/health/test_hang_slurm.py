"""The hang on real Slurm (the devcluster: ``eval "$(slurm/devcluster up)"``): a 2-node training job
rendered by the orchestrator (its retry loop, ``srun --kill-on-bad-exit``) runs the trainer CLI; rank 1's
process is SIGSTOPped mid-training. Rank 0's watchdog exits 70, the step ends, the script retries it in
the same allocation, and the retry resumes from the last checkpoint and finishes. Meanwhile ``status``
shows rank 1 stale on n2 and rank 0 stalled on n1."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.base.plan_types import JobResources
from orchestrator.readback.status import collect, format_rows
from orchestrator.render import ScriptSpec, render_sbatch
from orchestrator.world.runs import write_json
from tests.slurm_cli import sacct_final_state
from tests.train.harness import tiny_config, write_dataset
from tests.waits import JOB_S, wait_until
from trainer.checkpoint import protocol as ckpt

# The backstop covers the test's own bounded waits (JOB_S for the job to reach iteration 25, queueing
# included, on a loaded machine); the waits say what never happened, this only stops a hang.
pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]

HANG_TIMEOUT_S = 20  # status must see the stall (after STALE_S) before the watchdog ends it: a wide window
STALE_S = 3
ITERS = 400  # long enough that rank 1 is stopped mid-training even on a quiet machine
REPO = Path(__file__).resolve().parents[2]


def _metrics_iteration(path: Path) -> int:
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    return max((r["iteration"] for r in rows if "train/lm_loss" in r), default=0)


def _stall_seen(run: Path) -> str | None:
    """The status table once it shows rank 0 stalled and rank 1 stale (read once: the same look)."""
    rows = collect(str(run), stale_after_s=STALE_S)
    pattern = r"stalled: rank 0@n1 \(\d+ s\); stale: rank 1@n2 \(\d+ s\)"
    return format_rows(rows) if re.fullmatch(pattern, rows[0].health) else None


def test_sigstopped_rank_is_retried_from_the_last_checkpoint(tmp_path):
    data = write_dataset(str(tmp_path / "data"))
    run = tmp_path / "run"
    d = tiny_config(str(run), data, train={"iters": ITERS, "log_interval": 1, "save_interval": 20,
                                           "eval_interval": 50, "heartbeat_interval_s": 0.5,
                                           "hang_timeout_s": HANG_TIMEOUT_S, "preflight_timeout_s": 30})
    cfg = tmp_path / "resolved.yaml"
    cfg.write_text(yaml.safe_dump(d))
    (run / "logs").mkdir(parents=True)
    res = JobResources("slipway-hang-train", nodes=2, tasks_per_node=1, cpus_per_task=1, time_limit_min=10,
                       signal_delay_s=30, max_retries=1, max_timeouts=1)
    spec = ScriptSpec(res, f"{shlex.quote(sys.executable)} -m trainer.run --config {cfg}", str(run / "logs"),
                      "train", "hang", str(run / "stages" / "train"),
                      env=(("OMP_NUM_THREADS", "1"), ("PYTHONPATH", str(REPO))))  # this checkout's trainer
    script = run / "train.sbatch"
    script.write_text(render_sbatch(spec))
    out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=60,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    job = out.stdout.strip().split(";")[0]
    write_json(run / "run.json", {"run_id": "hang", "jobs": {"train": [
        {"job_id": job, "executor": "slurm", "state_dir": str(run / "stages" / "train")}]}})
    try:
        beat1 = run / "heartbeats" / "rank_00001.json"
        wait_until(lambda: _metrics_iteration(run / "train_metrics.jsonl") >= 25 and beat1.exists() and
                   json.loads(beat1.read_text())["iteration"] is not None, "iteration 25 on both ranks",
                   JOB_S)  # queueing included
        stopped = json.loads(beat1.read_text())
        os.kill(stopped["pid"], signal.SIGSTOP)  # the task on n2 (the devcluster's nodes are this host)
        saved = ckpt.read_tracker(str(run / "checkpoints"))
        # Between STALE_S and the watchdog: rank 1 is stale, rank 0 alive but stalled.
        status = wait_until(lambda: _stall_seen(run), "rank 1 stale and rank 0 stalled")
        wait_until(lambda: (run / "stages" / "train" / "retries").exists(), "the retry")
        ended = sacct_final_state(job, timeout=JOB_S)
        assert ended in ("COMPLETED", "FAILED", "CANCELLED"), f"the job did not end: {ended}"
    finally:
        subprocess.run(["scancel", job], timeout=60, check=False)
    assert sacct_final_state(job) == "COMPLETED"
    assert "retry attempt=1 after rc=70" in (run / "stages" / "train" / "retries").read_text()
    first = (run / "logs" / f"train_{job}_r0_a0_0.err").read_text()
    m = re.search(r"watchdog: no training progress for [\d.]+ s \(train.hang_timeout_s=20\) at iteration "
                  rf"(\d+), phase \w+; stopped progressing: rank 1 on n2 \(pid {stopped['pid']}; stale, "
                  r".* This rank, rank 0 of 2 \(host n1, pid \d+\), was waiting", first)
    assert m and int(m.group(1)) >= 25, first[-3000:]
    retry = (run / "logs" / f"train_{job}_r0_a1_0.err").read_text()
    resumed = re.search(r"loaded checkpoint from \S+ iteration (\d+)", retry)
    assert resumed and int(resumed.group(1)) >= saved >= 20, retry[-3000:]
    assert ckpt.read_tracker(str(run / "checkpoints")) == ITERS
    assert f"STALE: run run rank 1 on n2 (pid {stopped['pid']})" in status, status
    after = format_rows(collect(str(run)))  # the retry replaced the heartbeats; the hang stays on record
    assert f"HANG (recorded): run run job {job}, iteration {m.group(1)}: stopped progressing: rank 1 on n2 " \
        f"(pid {stopped['pid']}" in after, after
    assert "STALLED: run run rank 0 on n1" in status and "waiting in a collective" in status, status
    assert json.loads((run / "preflight.json").read_text())["nodes"] == {"n1": [0], "n2": [1]}
