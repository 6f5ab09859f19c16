"""`status` during a controller outage, on a real cluster: a second devcluster (beside the suite's, so the
other Slurm tests keep theirs) runs a job, its slurmctld is killed, and `status` says that the controller
did not answer and that the RUNNING it shows comes from accounting (slurmdbd still answers)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from orchestrator.runs import write_json
from orchestrator.status import collect, format_rows
from tests.slurm_cli import slurm

pytestmark = pytest.mark.slurm

DEVCLUSTER = Path(__file__).resolve().parents[2] / "slurm" / "devcluster"


@pytest.mark.timeout(400)
def test_status_names_an_unreachable_slurmctld(tmp_path, monkeypatch):
    state = tmp_path / "c"
    up = subprocess.run([str(DEVCLUSTER), "--dir", str(state), "up"], capture_output=True, text=True,
                        timeout=240)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        monkeypatch.setenv("SLURM_CONF", str(state / "etc" / "slurm.conf"))
        job = slurm("sbatch", "--parsable", "-N1", "-t", "5", "-o", str(tmp_path / "j.out"),
                    "--wrap", "sleep 300").strip().split(";")[0]
        deadline = time.monotonic() + 120
        while slurm("squeue", "-h", "-j", job, "-o", "%T").strip() != "RUNNING":
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(0.5)
        run = tmp_path / "run"
        run.mkdir()
        jobs = {"train": [{"job_id": job, "executor": "slurm"}]}
        write_json(run / "run.json", {"run_id": "run", "jobs": jobs})
        assert collect(str(run))[0].slurm_error == ""  # the controller answers: no warning
        deadline = time.monotonic() + 60  # accounting learns of the start asynchronously
        while slurm("sacct", "-n", "-X", "-P", "-j", job, "-o", "State").strip() != "RUNNING":
            assert time.monotonic() < deadline, "slurmdbd never recorded the job as RUNNING"
            time.sleep(0.5)
        os.kill(int((state / "pids" / "slurmctld.pid").read_text().split()[0]), signal.SIGKILL)
        rows = collect(str(run))
        assert rows[0].state == "RUNNING" and rows[0].slurm_error.startswith("squeue exited"), rows[0]
        text = format_rows(rows)
        assert "SLURM: slurmctld did not answer (squeue exited" in text
        assert "states above come from accounting (sacct) and may be stale" in text
    finally:
        subprocess.run([str(DEVCLUSTER), "--dir", str(state), "down"], capture_output=True, timeout=120)
