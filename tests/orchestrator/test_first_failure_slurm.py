"""On the devcluster (real Slurm, srun, two nodes), a failed training job's reason is the rank that failed
first, from srun's own report and the heartbeats (orchestrator/readback/culprit.py), and an out-of-memory
rank is not retried (issue 50, item 5; the local executor's cases are in test_local_promises.py).

Two tiny runs of the fault matrix's shape (tp=2 across n1 and n2, one task each; its dataset), submitted
at once: in ``killed`` rank 1 is SIGKILLed while both ranks are paused after iteration 3 (no retry, so the
job's last attempt is that one); in ``oom`` rank 1 runs out of memory after iteration 3 (the fault seam:
the real CPU allocator refuses) with the default two retries allowed."""

from __future__ import annotations

import io
import os
import re
import signal
import sys
import threading
from pathlib import Path

import pytest

from orchestrator.launch.flow import launch
from orchestrator.readback.status import collect, format_rows
from tests.orchestrator.conftest import compose_cfg
from tests.orchestrator.devcluster_helpers import cancel_runs, job_ids, wait_states
from tests.orchestrator.test_fault_matrix import COMMON, _dataset
from tests.seam import hook_env
from trainer.run_files import RETRIES, RunDir

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]

RUNS = {
    "killed": ["+cluster.env.SLIPWAY_STALL_TRAIN=3", "cluster.max_retries=0"],
    "oom": ["+cluster.env.SLIPWAY_FAIL_TRAIN=oom@1:3"],
}
BEATS = "train.heartbeat_interval_s=0.5"  # the paused ranks' heartbeats tell their iteration


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("first_failure")
    data, vocab, merges = _dataset(root)
    base = [*COMMON, f"data.paths=[{data}]", f"tokenizer.vocab_file={vocab}",
            f"tokenizer.merge_file={merges}", f"runs_root={root}/runs", f"cache_dir={root}/cache", BEATS]
    dirs = {name: root / "runs" / "codeparrot_smoke" / name for name in RUNS}
    stop, killed = threading.Event(), {}

    def kill_rank_1() -> None:  # once both ranks of ``killed`` paused: rank 1, the task on n2
        paused = dirs["killed"] / "stages" / "train" / "stalled_3_rank1"
        while not stop.wait(0.5):
            if paused.exists() and (dirs["killed"] / "stages" / "train" / "stalled_3_rank0").exists():
                killed["pid"] = int(RunDir(dirs["killed"]).rank_pid(1).read_text().split()[0])
                os.kill(killed["pid"], signal.SIGKILL)
                return

    driver = threading.Thread(target=kill_rank_1, daemon=True)
    os.environ.update(hook_env())  # the hooks are allowed for this module's launches and jobs
    try:
        for name, extra in RUNS.items():
            launch(compose_cfg([*base, f"run_id={name}", *extra]), out=io.StringIO())
        driver.start()
        yield dirs, killed
    finally:
        for name in hook_env():
            os.environ.pop(name, None)
        stop.set()
        cancel_runs(list(dirs.values()))


def _batch_log(run: Path) -> str:
    return (run / "logs" / f"train_{job_ids(run)['train']}_batch.out").read_text(errors="replace")


def test_a_rank_killed_on_slurm_is_the_reason_from_sruns_report(runs):
    dirs, killed = runs
    run = dirs["killed"]
    assert wait_states(run)["train"] == "FAILED"
    assert "pid" in killed, "rank 1 was never killed"
    batch = _batch_log(run)
    assert re.search(r"srun: error: n2: task 1: Killed\n", batch), batch  # srun's own words, read back
    table = format_rows(collect(str(run)))
    sys.stderr.write(table)  # shown with -s / on failure
    # "killed by SIGKILL" is srun's word (the heartbeats alone cannot tell a signal from a lost node); the
    # iteration is its last heartbeat's, written every 0.5 s: 2 or 3.
    assert re.search(rf"FAILED: run killed stage train \(job \d+\): rank 1 \(on n2, pid {killed['pid']}\) "
                     r"was killed by SIGKILL at iteration \d+, without an error of its own\n", table), table
    assert re.search(r"\n  after it: rank 0 \(on n1, pid \d+\) ", table), table


def test_an_out_of_memory_rank_on_slurm_is_the_reason_and_is_not_retried(runs):
    dirs, _ = runs
    run = dirs["oom"]
    assert wait_states(run)["train"] == "FAILED"
    assert not (run / "stages" / "train" / RETRIES).exists(), "an out-of-memory step was retried"
    batch = _batch_log(run)
    not_retried = "slipway: not retrying (a retry would repeat it): OutOfMemory: rank 1 ran out of memory"
    assert not_retried in batch, batch
    table = format_rows(collect(str(run)))
    sys.stderr.write(table)
    assert re.search(r"FAILED: run oom stage train \(job \d+\): OutOfMemory: rank 1 ran out of memory at "
                     r"iteration 3 with layout tp=2 pp=1 dp=1, micro-batch 2, sequence 64, recompute none, "
                     r"fp32: DefaultCPUAllocator: can't allocate memory: .* \(exit 78\)\n", table), table
    assert re.search(r"\n  after it: rank 0 \(on n1, pid \d+\) ", table), table
