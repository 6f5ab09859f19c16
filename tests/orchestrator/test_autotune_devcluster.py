"""layout=auto tune=true on the devcluster (issue 41, item 4): the trials are one real Slurm job array
(``--array=0-3%2``, at most two at once), each element a 2-node trial of the CPU model (gloo) on the run's
preprocessed data; the plan's first choice is made to run out of memory and Slurm records that element
FAILED, which stops neither the other trials nor training (``afterany``); the table is written and the
training job trains the fastest measured layout. About 40-90 s on two cores."""

from __future__ import annotations

import io
import json
import socket
from datetime import datetime
from pathlib import Path

import pytest

from orchestrator.launch.flow import launch
from orchestrator.record.launches import launch_dir
from orchestrator.stages.tune import NAME as TUNE
from orchestrator.world.queue import query_slurm
from tests.devcluster import settings
from tests.orchestrator.conftest import compose_cfg
from tests.orchestrator.devcluster_helpers import TINY_MODEL, cancel_runs, job_ids, wait_states
from tests.seam import enabled
from tests.slurm_cli import slurm
from trainer.checkpoint.protocol import saved_layout
from trainer.run_files import RunDir

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]

TUNED = [
    "+experiment=codeparrot_smoke", "cluster=devcluster", "data.corpus.max_files=12",
    "data.corpus.max_bytes=200000", "tokenizer.vocab_size=300", *TINY_MODEL,
    "parallel.pp_size=1", "cluster.tasks_per_node=1",  # 2 nodes × 1 task: world 2, tp within a node = 1
    "train.iters=6", "train.save_interval=6", "train.eval_interval=6", "convert.enabled=false", "eval=none",
    "layout=auto", "tune=true", "autotune.concurrency=2", "autotune.warmup_iters=2", "autotune.iters=4",
    "autotune.log_interval=2", "autotune.micro_batch_sizes=[1,2]", "autotune.recompute=[none,full]",
    "autotune.time_limit_min=10", "wait=false",
]


def _at_once(array: str) -> int:
    """The most elements of ``array`` that ran at the same time, from Slurm's accounting."""
    spans = []
    for line in slurm("sacct", "-j", array, "-X", "-n", "-P", "-o", "JobID,Start,End").split():
        _, start, end = line.split("|")
        spans.append((datetime.fromisoformat(start), datetime.fromisoformat(end)))
    return max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)


def test_the_trials_are_one_job_array_and_training_takes_the_fastest(tmp_path):
    cfg = compose_cfg([*TUNED, f"runs_root={tmp_path}/runs", f"cache_dir={tmp_path}/cache"])
    with enabled(FAIL_TRIAL="0:oom"):  # sbatch hands the launching environment to the jobs
        run = RunDir(launch(cfg, out=io.StringIO()).plan.run_dir)
    try:
        states = wait_states(run.root)
        assert states == dict.fromkeys(("corpus", "preprocess", TUNE, "train"), "COMPLETED"), states
    finally:
        cancel_runs([run.root])
    ids = job_ids(run.root)
    scripts = launch_dir(str(run.root), 1) / "scripts"
    assert "#SBATCH --array=0-3%2" in (scripts / "tune.sbatch").read_text()
    train = (scripts / "train.sbatch").read_text()
    assert f"--dependency=afterok:{ids['preprocess']},afterany:{ids[TUNE]}" in train

    # Slurm's own accounting: element 0 failed, the others completed, never more than two at once.
    array = ids[TUNE]
    _, acct = query_slurm([array])
    assert [acct[f"{array}_{i}"]["state"] for i in range(4)] == ["FAILED"] + ["COMPLETED"] * 3
    assert acct[array]["state"] == "FAILED" and _at_once(array) <= 2
    assert all((run.logs / f"tune_{array}_{i}_0.err").exists() for i in range(4))

    table = json.loads(run.layout_table.read_text())
    rows = {r["index"]: r for r in table["rows"]}
    assert rows[0]["status"] == "failed" and rows[0]["reason"].startswith("out of memory")
    assert sorted(r["index"] for r in table["rows"] if r["status"] == "measured") == [1, 2, 3]
    assert table["tune_job"] == array and table["winner"] in (1, 2, 3) and table["spearman_n"] == 3
    # Both rank correlations with the measurement are stored with the table and printed with it (issue 52
    # item 5); recomputation makes the estimates differ, so the step-time one is a number, not n/a.
    assert "spearman_step" in table and table["spearman_step"] is not None
    text = run.layout_table_text.read_text()
    assert f"estimated vs measured step time: {table['spearman_step']:+.2f} over 3" in text, text
    assert f"plan's ranking vs measured: {table['spearman']:+.2f} over 3 measured trial(s)" in text
    win = rows[table["winner"]]["overrides"]
    _, pp, args = saved_layout(str(run.checkpoints), 6)
    assert (pp, args.micro_batch_size, args.use_distributed_optimizer) == (
        win["parallel"]["pp_size"], win["train"]["micro_batch_size"], win["optim"]["distributed"])
    trained = "\n".join(p.read_text() for p in sorted(Path(run.logs).glob("train_*_0.err")))
    assert f"layout=auto: training with {rows[table['winner']]['name']}" in trained
    if settings().hosts:  # the trials ran on the nodes, hosts other than the launcher's, and worked
        for i in (1, 2, 3):  # rank 0 records the measurement, where it ran
            ran = json.loads(run.trial_record(i, 0).read_text())
            assert (ran["node"], ran["host"]) == ("n1", "n1") != (socket.gethostname(),) * 2, ran
