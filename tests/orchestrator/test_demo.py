"""The README's main job, end to end: `make demo` is `python launch.py` on the local executor (the bare
command composes the smoke experiment; test_config pins that). Here it runs as a user runs it, in a
subprocess, on a smaller budget (a 12-file corpus, a 300-entry BPE, 20 iterations) but with everything
else as shipped: corpus → tokenizer → preprocess → training at tp=2 × pp=2 (4 gloo processes) → convert
with verification → sample → eval of the smoke model (4 HumanEval problems, 2 samples at two temperatures,
executed in the sandbox; held-out perplexity) → summary, W&B offline.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.record.launches import current, current_jobs
from orchestrator.stages.tune import NAME as TUNE
from tests.orchestrator.conftest import REPO, stage_names
from tests.train.wandb_reader import history, run_files
from trainer.run_files import LOSS_PLOT, SUMMARY

ITERS = 20
SMALLER = [
    "data.corpus.max_files=12", "data.corpus.max_bytes=200000", "tokenizer.vocab_size=300", "data.workers=1",
    "data.split='80,20,0'", f"train.iters={ITERS}", "optim.warmup_iters=5", "train.save_interval=10",
    "train.eval_interval=10", "train.eval_iters=1", "train.log_interval=5",
]


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    root = tmp_path_factory.mktemp("demo")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "launch.py", f"runs_root={root}", *SMALLER], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=540)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    runs = list((root / "smoke").iterdir())
    assert len(runs) == 1, runs
    return res, runs[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_says_only_what_happened(demo):
    """Issue 52, item 6: a stage waiting for its upstream is PENDING (Dependency) meanwhile, never RUNNING
    before the upstream completed; the eval job, which replays no iteration, does not warn that W&B keeps
    earlier values."""
    res, _ = demo
    states = re.findall(r"\] (\w+) job \d+: (\w+)", res.stderr)
    for stage, upstream in (("train", "preprocess"), ("convert", "train"), ("eval", "convert")):
        assert (stage, "PENDING") in states, (stage, states)
        assert (stage, "RUNNING") not in states[:states.index((upstream, "COMPLETED"))], (stage, states)
    assert "W&B keeps the earlier values" not in res.stderr and "resumes from iteration" not in res.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_runs_every_stage_at_tp2_pp2(demo):
    _, run = demo
    meta = json.loads((run / "run.json").read_text())
    assert set(current_jobs(meta)) == set(stage_names(TUNE))
    for stage in stage_names(TUNE):
        state_dir = Path(current(meta)["stages"][stage]["dir"])
        assert (run / "stages" / stage / "_COMPLETE").exists() or (state_dir / "_COMPLETE").exists(), stage
    shards = sorted(p.name for p in (run / "checkpoints" / f"iter_{ITERS:07d}").iterdir())
    assert shards == ["manifest.json", "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_summary_is_printed_saved_and_true(demo):
    res, run = demo
    text = (run / SUMMARY).read_text()
    assert text in res.stdout  # printed at the end, and saved
    rows = [json.loads(x) for x in (run / "train_metrics.jsonl").read_text().splitlines()]
    last_train = [r for r in rows if "train/lm_loss" in r][-1]
    last_valid = [r for r in rows if "valid/lm_loss" in r][-1]
    assert f"run directory    {run}" in text
    assert f"train loss       {last_train['train/lm_loss']:.3f} (iteration {ITERS})" in text
    assert f"validation loss  {last_valid['valid/lm_loss']:.3f} (iteration {ITERS})" in text
    assert last_train["train/lm_loss"] < [r for r in rows if "train/lm_loss" in r][0]["train/lm_loss"]
    assert f"loss curve       {run / LOSS_PLOT}" in text
    assert (run / LOSS_PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"HF model         {run / 'hf'}" in text
    assert re.search(r"verification PASSED: max \|Δlogit\| = [\d.e+-]+ \(fp32, limit 0.0001\)", text), text
    sample = (run / "sample.txt").read_text()
    assert "def fibonacci(" in sample and "sample           def fibonacci(" in text
    assert "max_new_tokens=32" in text  # the "try it" line is a command that runs as printed
    # The kernel self-check ran on every rank of the tp2 x pp2 job and agreed: all csrc ops kept.
    assert "kernels          9 fused ops (csrc) agree with eager on cpu float32 (self-check" in text


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_hf_folder_loads_and_wandb_offline_run_has_every_iteration(demo):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    res, run = demo
    hf = run / "hf"
    assert not (hf / "INVALID").exists()
    model = AutoModelForCausalLM.from_pretrained(hf)
    tok = AutoTokenizer.from_pretrained(hf)
    assert model.config.n_layer == 4 and model.config.n_embd == 128 and len(tok) <= model.config.vocab_size
    files = run_files(str(run))
    assert len(files) == 2, files  # the training's, then the eval stage's (the same W&B run resumed)
    offline = Path(files[0]).parent
    assert f"wandb sync {offline}" in (run / SUMMARY).read_text()
    steps = sorted({r["_step"] for r in history(files[0]) if "train/lm_loss" in r})
    assert steps == list(range(5, ITERS + 1, 5)), steps


EVAL_BUDGET_S = 120  # the smoke eval's share of the demo (measured: see bench/README.md)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_demo_evaluates_the_smoke_model_in_budget(demo):
    res, run = demo
    results = json.loads((run / "eval" / "results.json").read_text())
    he = results["humaneval"]
    assert he["problems"] == 4 and set(he["pass_at"]) == {"pass@1", "pass@2"}
    assert [sum(r["statuses"].values()) for r in he["by_temperature"]] == [8, 8]
    assert results["model"] == str(run / "hf") and he["isolation"]  # which containment: recorded
    held = results["perplexity"]["heldout"]
    assert held["split"] == "valid" and held["tokens"] > 0
    # The converted model on held-out samples, beside the trainer's own last validation loss.
    assert held["training_valid_loss"]["iteration"] == ITERS
    assert results["seconds"] < EVAL_BUDGET_S, results["seconds"]
    text = (run / SUMMARY).read_text()
    assert "evaluation       pass@1 " in text and "on held-out valid split" in text
    assert "## Evaluation" in (run / "hf" / "README.md").read_text()
    files = run_files(str(run))
    rows = [r for r in history(files[-1]) if "eval/humaneval_pass_at_1" in r]
    assert len(rows) == 1 and rows[0]["_step"] == ITERS + 1
