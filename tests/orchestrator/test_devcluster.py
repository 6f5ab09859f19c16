"""Real jobs on the devcluster (``slurm/devcluster up``; ``eval "$(slurm/devcluster env)"``).

Every test is the smoke pipeline scaled down (a tiny stdlib corpus, a 300-entry BPE, a 4-layer GPT at
tp=2 × pp=2 over 2 nodes × 2 tasks, a few iterations) so each stays within a few minutes on 2 cores.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.launcher import launch
from orchestrator.status import collect, query_slurm
from orchestrator.validate import PlanError
from tests.orchestrator.conftest import REPO, compose_cfg

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]

TINY = [
    "+experiment=codeparrot_smoke",
    "cluster=devcluster",
    "data.corpus.max_files=12",
    "data.corpus.max_bytes=200000",
    "tokenizer.vocab_size=300",
    "data.workers=1",
    "train.eval_iters=1",
    "train.log_interval=1",
    "cluster.stage_cpus=1",
    "optim.warmup_iters=1",
    "data.split='80,20,0'",
]


def _cfg(tmp: Path, *extra: str):
    return compose_cfg(TINY + [f"runs_root={tmp}/runs", f"cache_dir={tmp}/cache", *extra])


def _my_jobs() -> set[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i|%j"], capture_output=True, text=True, timeout=60)
    return {line.split("|")[0] for line in out.stdout.splitlines() if "|slipway-" in line}


def _wait_states(run_dir: Path, timeout_s: float = 600) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = collect(str(run_dir))
        states = {r.stage: r.state for r in rows}
        if all(
            s not in ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "UNKNOWN")
            for s in states.values()
        ):
            return states
        time.sleep(3)
    raise AssertionError(f"jobs of {run_dir} still running: {states}")


def _job_ids(run_dir: Path) -> dict[str, str]:
    meta = json.loads((run_dir / "run.json").read_text())
    return {stage: entries[-1]["job_id"] for stage, entries in meta["jobs"].items()}


def _losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "train_metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "train/lm_loss" in row:
            out[int(row["iteration"])] = row["train/lm_loss"]
    return out


def test_validation_errors_never_reach_squeue(tmp_path):
    before = _my_jobs()
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
    assert _my_jobs() == before
    assert not (tmp_path / "runs").exists()


def test_smoke_pipeline_completes(tmp_path):
    res = launch(
        _cfg(tmp_path, "train.iters=6", "train.save_interval=3", "train.eval_interval=3", "wait=true"),
        out=io.StringIO(),
    )
    run = Path(res.plan.run_dir)
    ids = _job_ids(run)
    assert set(ids) == {"corpus", "preprocess", "train", "convert"}
    _, sacct = query_slurm(list(ids.values()))
    assert {s: sacct[j]["state"] for s, j in ids.items()} == dict.fromkeys(ids, "COMPLETED")
    assert sacct[ids["train"]]["nodes"] in ("n[1-2]", "n1,n2")  # two nodes
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert (run / "checkpoints" / "iter_0000006" / "mp_rank_01_001" / "model_optim_rng.pt").exists()
    assert (run / "hf" / "model.safetensors").exists() and (run / "hf" / "config.json").exists()
    done = json.loads((run / "stages" / "convert" / "_COMPLETE").read_text())
    assert "verification PASSED" in done["result"]["result"]
    logs = sorted(p.name for p in (run / "logs").glob("train_*_r0_a0_*.err"))
    assert len(logs) == 4  # one per task, restart and attempt in the name


def test_failed_training_never_converts(tmp_path):
    res = launch(_cfg(tmp_path, "fail_train=start", "train.iters=4", "wait=false"), out=io.StringIO())
    run = Path(res.plan.run_dir)
    states = _wait_states(run)
    assert states["train"] == "FAILED"
    ids = _job_ids(run)
    _, sacct = query_slurm([ids["convert"]])
    assert sacct[ids["convert"]]["state"] in ("CANCELLED", "PENDING")  # never ran
    assert not (run / "hf").exists() and not list((run / "logs").glob("convert_*"))
    if sacct[ids["convert"]]["state"] == "PENDING":
        subprocess.run(["scancel", ids["convert"]], timeout=60)


def test_sweep_shares_one_preprocess_and_relaunch_reuses(tmp_path):
    def sweep(name):
        cmd = [
            sys.executable,
            "launch.py",
            "-m",
            *TINY,
            "optim.lr=1e-3,2e-3",
            f"runs_root={tmp_path}/runs",
            f"cache_dir={tmp_path}/cache",
            "train.iters=3",
            "train.save_interval=3",
            "convert.enabled=false",
            f"hydra.sweep.dir={tmp_path}/{name}",
        ]
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=os.environ)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads((tmp_path / name / "sweep.json").read_text())

    first = sweep("s1")
    runs = [Path(p["run_dir"]) for p in sorted(first["points"], key=lambda p: p["point"])]
    prep_jobs = {j for p in first["points"] for s, j in p["jobs"].items() if s == "preprocess" and j}
    assert len(prep_jobs) == 1  # the second point depended on the first point's job
    for run in runs:
        assert _wait_states(run)["train"] == "COMPLETED"
    names = [json.loads((r / "run.json").read_text())["name"] for r in runs]
    assert names[0] != names[1]
    wandb_ids = {json.loads((r / "wandb_run.json").read_text())["id"] for r in runs}
    assert len(wandb_ids) == 2  # distinct W&B runs (group = sweep id, see test_status_sweep)
    second = sweep("s2")
    actions = [json.loads((Path(p["run_dir"]) / "run.json").read_text())["jobs"] for p in second["points"]]
    assert all("preprocess" not in a and "corpus" not in a for a in actions)  # reused, nothing resubmitted
    for p in second["points"]:
        _wait_states(Path(p["run_dir"]))


def _wait_for(cond, timeout_s=400, what=""):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(1)
    raise AssertionError(f"timed out waiting for {what}")


def test_usr2_requeue_resumes_with_identical_losses(tmp_path):
    common = [
        "train.iters=12",
        "train.save_interval=4",
        "train.eval_interval=100",
        "train.deterministic=true",
        "convert.enabled=false",
        "wait=false",
    ]
    base = launch(_cfg(tmp_path / "a", *common), out=io.StringIO())
    run = launch(_cfg(tmp_path / "b", *common), out=io.StringIO())
    rb = Path(run.plan.run_dir)
    metrics = rb / "train_metrics.jsonl"
    _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 5, what="iteration 5")
    job = _job_ids(rb)["train"]
    subprocess.run(["scancel", "--signal=USR2", "--batch", job], check=True, timeout=60)
    assert _wait_states(rb)["train"] == "COMPLETED"
    assert _wait_states(Path(base.plan.run_dir))["train"] == "COMPLETED"
    assert len((rb / "stages" / "train" / "requeues").read_text().splitlines()) == 1
    assert list((rb / "logs").glob("train_*_r1_a0_0.err"))  # the restart shows in the log names
    la, lb = _losses(Path(base.plan.run_dir)), _losses(rb)
    assert sorted(la) == sorted(lb) == list(range(1, 13))
    assert lb == pytest.approx(la, rel=0, abs=0)


def test_killed_rank_is_retried_from_the_last_checkpoint(tmp_path):
    res = launch(
        _cfg(
            tmp_path,
            "train.iters=12",
            "train.save_interval=4",
            "train.eval_interval=100",
            "convert.enabled=false",
            "wait=false",
        ),
        out=io.StringIO(),
    )
    run = Path(res.plan.run_dir)
    latest = run / "checkpoints" / "latest_checkpointed_iteration.txt"
    _wait_for(lambda: latest.exists(), what="the first checkpoint")
    pid = int((run / "pids" / "rank1.pid").read_text().split()[0])
    os.kill(pid, signal.SIGKILL)  # a rank this test's job started
    assert _wait_states(run)["train"] == "COMPLETED"
    assert len((run / "stages" / "train" / "retries").read_text().splitlines()) == 1
    assert latest.read_text().strip() == "12"
    assert list((run / "logs").glob("train_*_r0_a1_0.err"))  # the retry's own logs
