"""Real jobs on the devcluster (``slurm/devcluster up``; ``eval "$(slurm/devcluster env)"``).

The smoke pipeline scaled down (a tiny stdlib corpus, a 300-entry BPE, a 4-layer GPT) on 2 nodes. The module
fixture submits the runs up front so they progress side by side; they share one corpus and one
preprocessing job through the content-addressed cache. Faults (preemption, time limit, killed ranks, disk
full, corrupt data, double launch) are in test_fault_matrix.py.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.base.problems import PlanError
from orchestrator.launch.flow import launch
from orchestrator.record.launches import current, current_jobs
from orchestrator.world.queue import query_slurm
from tests.devcluster import settings
from tests.orchestrator.conftest import REPO, compose_cfg
from tests.orchestrator.devcluster_helpers import TINY_MODEL, cancel_runs, job_ids, my_jobs, wait_states
from tests.seam import enabled

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]

TINY = [
    "+experiment=codeparrot_smoke",
    "cluster=devcluster",
    "data.corpus.max_files=12",
    "data.corpus.max_bytes=200000",
    "tokenizer.vocab_size=300",
    *TINY_MODEL,
]
# One task per node, tp=2 across the nodes: a quarter of the CPUs of the smoke layout (tp=2 × pp=2 on
# 2 nodes × 2 tasks, which the pipeline test keeps), so the other runs fit beside it.
SMALL = ["parallel.pp_size=1", "cluster.tasks_per_node=1"]


@dataclass
class Runs:
    root: Path
    smoke: Path
    failing: Path
    sweep1: dict


def _cfg(root: Path, *extra: str):
    return compose_cfg([*TINY, f"runs_root={root}/runs", f"cache_dir={root}/cache", *extra])


def _sweep(root: Path, name: str) -> dict:
    cmd = [sys.executable, "launch.py", "-m", *TINY, *SMALL, "optim.lr=1e-3,2e-3", f"runs_root={root}/runs",
           f"cache_dir={root}/cache", "train.iters=3", "train.save_interval=3", "convert.enabled=false",
           f"hydra.sweep.dir={root}/{name}"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=os.environ)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((root / name / "sweep.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Submit a two-point sweep (first: its first point submits the corpus and preprocessing jobs, the
    second depends on them), the pipeline and a run that fails; all of them share the data."""
    root = tmp_path_factory.mktemp("devcluster")
    r = Runs(root, root, root, {})
    try:
        r.sweep1 = _sweep(root, "s1")
        pipeline = ["train.iters=6", "train.save_interval=3", "train.eval_interval=3", "wait=false"]
        r.smoke = Path(launch(_cfg(root, *pipeline), out=io.StringIO()).plan.run_dir)
        failing = _cfg(root, *SMALL, "train.iters=4", "wait=false")
        with enabled(FAIL_TRAIN="start"):  # sbatch hands the launching environment to the job
            r.failing = Path(launch(failing, out=io.StringIO()).plan.run_dir)
        yield r
    finally:
        sweeps = [json.loads(s.read_text()) for s in root.glob("s*/sweep.json")]
        points = [Path(p["run_dir"]) for s in sweeps for p in s["points"]]
        cancel_runs([p for p in (r.smoke, r.failing, *points) if p != root])


def test_validation_errors_never_reach_squeue(tmp_path):
    before = set(my_jobs())
    for bad in (
        ["parallel.tp_size=3"],
        ["train.global_batch_size=5"],
        ["model.seq_length=256"],
        ["cluster.nodes=3"],
        ["train.precision=fp16"],
        ["data.split='x'"],
    ):
        with pytest.raises(PlanError):
            launch(_cfg(tmp_path, *bad), out=io.StringIO())
    assert not set(my_jobs()) - before
    assert not (tmp_path / "runs").exists()


def test_smoke_pipeline_completes(runs):
    run = runs.smoke
    # data: the sweep's jobs; eval: the smoke model's HumanEval + perplexity as a Slurm job after convert
    assert wait_states(run) == {"train": "COMPLETED", "convert": "COMPLETED", "eval": "COMPLETED"}
    stages = current(json.loads((run / "run.json").read_text()))["stages"]
    assert all((Path(stages[s]["dir"]) / "_COMPLETE").exists() for s in ("corpus", "preprocess"))
    if settings().hosts:  # every stage ran on a node, a host other than the launcher's, and worked
        for stage in ("corpus", "preprocess", "train", "convert", "eval"):
            done = json.loads((Path(stages[stage]["dir"]) / "_COMPLETE").read_text())
            assert done["node"] in ("n1", "n2") and done["host"] == done["node"] != socket.gethostname(), done
    ids = job_ids(run)
    _, sacct = query_slurm(list(ids.values()))
    assert sacct[ids["train"]]["nodes"] in ("n[1-2]", "n1,n2")  # two nodes
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert (run / "checkpoints" / "iter_0000006" / "mp_rank_01_001" / "model_optim_rng.pt").exists()
    assert (run / "hf" / "model.safetensors").exists() and (run / "hf" / "config.json").exists()
    done = json.loads((run / "stages" / "convert" / "_COMPLETE").read_text())
    assert "verification PASSED" in done["result"]["result"]
    logs = sorted(p.name for p in (run / "logs").glob("train_*_r0_a0_*.err"))
    assert len(logs) == 4  # one per task, restart and attempt in the name
    report = json.loads((run / "data_report.json").read_text())
    assert report["skipped_lines"] == 0 and report["summaries"][0]["documents"] > 0
    results = json.loads((run / "eval" / "results.json").read_text())
    he = results["humaneval"]
    assert he["problems"] == 4 and set(he["pass_at"]) == {"pass@1", "pass@2"}
    assert results["perplexity"]["heldout"]["tokens"] > 0 and results["model"] == str(run / "hf")
    assert list((run / "logs").glob("eval_*")) and "## Evaluation" in (run / "hf" / "README.md").read_text()


def test_failed_training_never_converts(runs):
    run = runs.failing
    states = wait_states(run)
    assert states["train"] == "FAILED"
    ids = job_ids(run)
    _, sacct = query_slurm([ids["convert"]])
    assert sacct[ids["convert"]]["state"] in ("CANCELLED", "PENDING")  # never ran
    assert not (run / "hf").exists() and not list((run / "logs").glob("convert_*"))
    if sacct[ids["convert"]]["state"] == "PENDING":
        subprocess.run(["scancel", ids["convert"]], timeout=60)


def test_sweep_shares_one_preprocess_and_relaunch_reuses(runs):
    first = runs.sweep1
    points = [Path(p["run_dir"]) for p in sorted(first["points"], key=lambda p: p["point"])]
    prep_jobs = {j for p in first["points"] for s, j in p["jobs"].items() if s == "preprocess" and j}
    assert len(prep_jobs) == 1  # the second point depended on the first point's job
    for run in points:
        assert wait_states(run)["train"] == "COMPLETED"
    names = [json.loads((r / "run.json").read_text())["name"] for r in points]
    assert names[0] != names[1]
    wandb_ids = {json.loads((r / "wandb_run.json").read_text())["id"] for r in points}
    assert len(wandb_ids) == 2  # distinct W&B runs (group = sweep id, see test_status_sweep)
    second = _sweep(runs.root, "s2")
    actions = [current_jobs(json.loads((Path(p["run_dir"]) / "run.json").read_text()))
               for p in second["points"]]
    assert all("preprocess" not in a and "corpus" not in a for a in actions)  # reused, nothing resubmitted
    assert all(set(a) == {"train"} for a in actions)
    subprocess.run(["scancel", *(a["train"][-1]["job_id"] for a in actions)], timeout=60)  # not needed
