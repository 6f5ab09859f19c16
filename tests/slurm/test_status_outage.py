"""`status` when Slurm itself fails, on a real cluster: a second devcluster beside the suite's (so the other
Slurm tests keep theirs). First a node dies under a job (Slurm marks NODE_FAIL and requeues it: `status`
counts that restart, which no Slipway file records); then its slurmctld is killed while a job runs
(`status` says the controller did not answer and that the RUNNING it shows comes from accounting).
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.readback.status import collect, format_rows
from orchestrator.world.runs import write_json
from tests.slurm_cli import TERMINAL, sacct_states, slurm
from tests.waits import JOB_S, wait_until

pytestmark = pytest.mark.slurm

DEVCLUSTER = Path(__file__).resolve().parents[2] / "slurm" / "devcluster"


def _devcluster(state: Path, verb: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(DEVCLUSTER), "--dir", str(state), verb], capture_output=True, text=True,
                          timeout=240)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Path]:
    state = tmp_path_factory.mktemp("second") / "c"
    up = _devcluster(state, "up")
    assert up.returncode == 0, up.stdout + up.stderr
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(state / "etc" / "slurm.conf")
    try:
        yield state
    finally:
        os.environ.pop("SLURM_CONF") if old is None else os.environ.__setitem__("SLURM_CONF", old)
        _devcluster(state, "down")


def _run_dir(tmp_path: Path, job: str) -> Path:
    run = tmp_path / "run"
    (run / "stages" / "train").mkdir(parents=True)
    jobs = {"train": [{"job_id": job, "executor": "slurm", "state_dir": str(run / "stages" / "train")}]}
    write_json(run / "run.json", {"run_id": "run", "jobs": jobs})
    return run


def _state(job: str) -> str:
    return slurm("squeue", "-h", "-j", job, "-o", "%T").strip()


@pytest.mark.timeout(420)
def test_a_node_failure_requeue_counts_as_a_restart(cluster, tmp_path):
    pid_file = tmp_path / "batch.pid"
    script = tmp_path / "job.sh"
    # The first run waits to be killed with its node; the requeued run ends at once.
    script.write_text(f'#!/bin/bash\nif [ "${{SLURM_RESTART_COUNT:-0}}" = 0 ]; then echo $$ > {pid_file}; '
                      "sleep 600; fi\n")
    job = slurm("sbatch", "--parsable", "--requeue", "-N1", "-w", "n2", "-t", "10", "-o",
                str(tmp_path / "j.out"), str(script)).strip().split(";")[0]
    wait_until(lambda: _state(job) == "RUNNING" and pid_file.exists(), "the job to run on n2", poll_s=0.5)
    run = _run_dir(tmp_path, job)
    assert collect(str(run))[0].restarts == 0
    # The node dies: its slurmd and the job's processes (the batch shell's slurmstepd with them).
    batch = int(pid_file.read_text())
    stepd = int(Path(f"/proc/{batch}/stat").read_text().rsplit(")", 1)[1].split()[1])
    os.kill(int((cluster / "pids" / "slurmd-n2.pid").read_text().split()[0]), signal.SIGKILL)
    for pid in (stepd, batch):
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: "NODE_FAIL" in sacct_states(job, duplicates=True), "Slurm to mark the job NODE_FAIL",
               JOB_S, poll_s=0.5)
    up = _devcluster(cluster, "up")  # the node comes back (ReturnToService=2); the requeued job runs there
    assert up.returncode == 0, up.stdout + up.stderr
    # The latest record reads NODE_FAIL until the requeued run is accounted for: wait for that run's end.
    wait_until(lambda: sacct_states(job, duplicates=True)[-1] in TERMINAL - {"NODE_FAIL"},
               "the requeued run to end", JOB_S, poll_s=0.5)
    assert sacct_states(job, duplicates=True)[-1] == "COMPLETED", sacct_states(job, duplicates=True)
    rows = collect(str(run))
    assert not (run / "stages" / "train" / "requeues").exists()  # no Slipway file knows of this restart
    assert rows[0].restarts == 1, (rows[0], sacct_states(job, duplicates=True))


@pytest.mark.timeout(300)
def test_status_names_an_unreachable_slurmctld(cluster, tmp_path):
    job = slurm("sbatch", "--parsable", "-N1", "-t", "5", "-o", str(tmp_path / "j.out"),
                "--wrap", "sleep 300").strip().split(";")[0]
    wait_until(lambda: _state(job) == "RUNNING", "the job to start", poll_s=0.5)
    run = _run_dir(tmp_path, job)
    assert collect(str(run))[0].slurm_error == ""  # the controller answers: no warning
    wait_until(lambda: sacct_states(job) == ["RUNNING"], "slurmdbd to record the job as RUNNING",
               poll_s=0.5)
    os.kill(int((cluster / "pids" / "slurmctld.pid").read_text().split()[0]), signal.SIGKILL)
    rows = collect(str(run))
    assert rows[0].state == "RUNNING" and rows[0].slurm_error.startswith("squeue exited"), rows[0]
    text = format_rows(rows)
    assert "SLURM: slurmctld did not answer (squeue exited" in text
    assert "states above come from accounting (sacct) and may be stale" in text
