"""A bad node is not retried into (orchestrator/render.py, trainer/health/badnodes.py), and ``logs``/``list``
follow such a run (orchestrator/readback/logs.py, listing.py), on the devcluster.

A one-node training job (2 ranks, tp=2) stalls after iteration 3 (``SLIPWAY_STALL_TRAIN``: every rank
pauses until a signal, so nothing races the run); the test SIGSTOPs rank 1. Rank 0's hang watchdog names
rank 1's node and ends the step; the batch script finds the node named, asks a helper job to exclude it,
and requeues the job held. The helper sets ``ExcNodeList`` on the pending job and releases it: the job's
next run lands on the other node, resumes, and completes. ``status`` says which node and why. Meanwhile
``python -m orchestrator logs RUN train --follow``, started before the job ran, prints the first run's log
and then the requeued one's, and returns when the job has ended.

A two-node job cannot leave either node of the devcluster's two: there the node is kept, the step is
retried in the same allocation (tests/health/test_hang_slurm.py), and the exclusions file says why.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.launch.flow import launch
from orchestrator.readback.status import collect, format_rows
from tests.orchestrator.conftest import REPO, compose_cfg
from tests.orchestrator.devcluster_helpers import (
    TINY_MODEL,
    cancel_runs,
    job_ids,
    tiny_dataset,
    wait_for,
    wait_states,
)
from tests.seam import enabled
from tests.slurm_cli import slurm
from tests.waits import JOB_S, NEVER_S
from trainer.run_files import EXCLUSIONS, RunDir

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]


def _nodes(job: str) -> list[str]:
    """The node of each run of the job (a requeued job has one accounting record per run), oldest first."""
    out = slurm("sacct", "-n", "-P", "-X", "-D", "-j", job, "-o", "NodeList,State")
    return [line.split("|")[0] for line in out.splitlines() if line.strip()]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=NEVER_S)


@dataclass
class Scenario:
    root: Path
    run: Path
    job: str
    first: str  # the node the job ran on first, whose rank was stopped
    follow: str  # what `logs --follow` printed, started before the job ran
    follow_rc: int


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> Scenario:
    root = tmp_path_factory.mktemp("badnode")
    overrides = ["+experiment=codeparrot_smoke", "cluster=devcluster", *TINY_MODEL, *tiny_dataset(root),
                 "parallel.tp_size=2", "parallel.pp_size=1", "cluster.nodes=1", "cluster.tasks_per_node=2",
                 "train.iters=6", "train.save_interval=3", "train.eval_interval=100",
                 "train.hang_timeout_s=10", "train.heartbeat_interval_s=0.5", "convert.enabled=false",
                 "eval=none", "logging.wandb.mode=disabled", "kernels=eager", "wait=false",
                 "+cluster.env.SLIPWAY_STALL_TRAIN=3", f"runs_root={root}/runs", f"cache_dir={root}/cache",
                 "run_id=badnode"]
    run = root / "runs" / "codeparrot_smoke" / "badnode"
    follower = None
    try:
        with enabled():  # the switch: the stall hook is a test hook (sbatch passes it to the job)
            launch(compose_cfg(overrides), out=io.StringIO())
        cmd = [sys.executable, "-m", "orchestrator", "logs", str(run), "train", "--follow"]
        follower = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
        state = run / "stages" / "train"
        wait_for(lambda: (state / "stalled_3_rank1").exists(), JOB_S, "rank 1 to stall after iteration 3")
        job = job_ids(run)["train"]
        first = _nodes(job)[0]
        pid = int(RunDir(run).rank_pid(1).read_text().split()[0])
        os.kill(pid, signal.SIGSTOP)  # its heartbeat goes stale; rank 0's watchdog names its node
        assert wait_states(run)["train"] == "COMPLETED", format_rows(collect(str(run)))
        out, _ = follower.communicate(timeout=NEVER_S)  # it returns once it sees the job ended
        yield Scenario(root, run, job, first, out, follower.returncode)
    finally:
        if follower is not None and follower.poll() is None:
            follower.kill()
        cancel_runs([run])


def test_a_node_the_watchdog_names_is_excluded_from_the_next_allocation(scenario):
    run, job, first = scenario.run, scenario.job, scenario.first
    nodes = _nodes(job)
    assert len(nodes) >= 2 and nodes[0] == first and nodes[-1] not in ("", first), nodes
    decisions = (run / "stages" / "train" / EXCLUSIONS).read_text().splitlines()
    assert len(decisions) == 1, decisions
    assert f" excluded {first} job={job} restart=0 attempt=0 exclude={first} " in decisions[0], decisions
    helper = decisions[0].rsplit("helper=", 1)[1]
    assert slurm("sacct", "-n", "-X", "-P", "-j", helper, "-o", "State").split() == ["COMPLETED"]
    batch = (run / "logs" / f"train_{job}_batch.out").read_text()
    assert f"slipway: excluding node(s) {first} from the next allocation" in batch, batch[-3000:]
    table = format_rows(collect(str(run)))
    line = next((x for x in table.splitlines() if x.startswith("BAD NODE: run badnode: ")), "")
    assert f"{first} named by the watchdog (job {job}, restart 0, attempt 0): rank 1 on {first}" in line, \
        table
    assert f"excluded from the job's next allocation (ExcNodeList={first}, set by helper job {helper})" \
        in line, table


def test_logs_follows_the_requeue_and_prints_any_attempt(scenario):
    run, job = scenario.run, scenario.job
    follow = scenario.follow
    assert scenario.follow_rc == 0, follow[-3000:]
    before, _, after = follow.partition(f"──── job {job}, restart 1, attempt 0, task 0, stderr: ")
    assert after, f"no switch to the requeued run's log:\n{follow[-3000:]}"
    assert "iteration        2/" in before and "watchdog: no training progress" in before, before[-3000:]
    assert "iteration        6/" in after, after[-3000:]
    first = _cli("logs", str(run), "train", "--restart", "0")  # any attempt: the first run's
    assert first.returncode == 0 and "watchdog: no training progress" in first.stdout, first.stderr
    assert f"train_{job}_r0_a0_0.err" in first.stderr
    latest = _cli("logs", str(run))  # default: nothing failed or runs, so training; its latest attempt
    assert latest.returncode == 0 and "iteration        6/" in latest.stdout, latest.stderr
    assert f"train_{job}_r1_a0_0.err" in latest.stderr
    batch = _cli("logs", str(run), "train", "--batch")
    assert "exited with 70" in batch.stdout and "exited with 0" in batch.stdout, batch.stdout
    prep = _cli("logs", str(run), "preprocess", "--stdout")  # a shared stage logs beside its output
    assert prep.returncode == 0 and str(scenario.root / "cache") in prep.stderr, prep.stderr
    listed = _cli("logs", str(run), "train", "--list")
    assert f"train_{job}_r0_a0_1.err" in listed.stdout and "_exclude_" in listed.stdout, listed.stdout
    missing = _cli("logs", str(run), "train", "--attempt", "5")
    assert missing.returncode == 2 and "--list" in missing.stderr, missing.stderr


def test_list_shows_the_run_with_its_state_iteration_and_loss(scenario):
    out = _cli("list", str(scenario.root / "runs"))
    assert out.returncode == 0, out.stderr
    row = next(x for x in out.stdout.splitlines() if x.startswith("codeparrot_smoke/badnode "))
    cells = row.split()
    assert cells[1:5] == ["COMPLETED", "train", "6", "6"], out.stdout
    assert float(cells[5]) > 0
