"""The eval stage's work on a real (tiny, random) Hugging Face model: batched left-padded sampling,
sandboxed execution, held-out and JSONL perplexity, results.json, the model card and the W&B run the
training started (real wandb, offline)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.logs import captured
from tests.train.wandb_reader import history, run_files, run_ids
from trainer.eval.config import EvalConfig
from trainer.eval.run import EvalRun, run_eval

SMOKE = dict(enabled=True, humaneval_problems=3, n_samples=2, pass_at_k=[1, 2], temperatures=[0.2, 0.8],
             max_new_tokens=12, batch_size=4, allow_code_execution=True, heldout_samples=6)


def _wandb_training_run(run_dir: Path) -> dict:
    """What the trainer leaves: an offline W&B run (id in wandb_run.json) with steps 1..5 logged."""
    from trainer.config import WandbConfig
    from trainer.run.metrics import WandbLogger

    wcfg = {"mode": "offline", "project": "slipway-test"}
    logger = WandbLogger(WandbConfig(**wcfg), str(run_dir), "evalrun1", {}, True)
    for step in range(1, 6):
        logger.log({"train/lm_loss": 7.0 - step / 10}, step=step)
    logger.finish()
    return wcfg


def test_run_eval_writes_results_card_and_the_same_wandb_run(tmp_path, hf_dir, data_prefix):
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    wcfg = _wandb_training_run(run_dir)
    extra = tmp_path / "extra.jsonl"
    extra.write_text(json.dumps({"content": "def add(a, b):\n    return a + b\n"}) + "\n")
    settings = EvalConfig(**SMOKE, perplexity_files=[str(extra)])
    run = EvalRun(str(hf_dir), str(run_dir / "eval"), settings, data_prefix, "80,20,0", 64, "content",
                  str(run_dir), "evalrun1", wcfg)
    with captured("slipway.trainer.run.metrics") as said:
        results = run_eval(run)
    # Evaluation replays no training iteration: nothing W&B logged earlier is in question (issue 52,
    # item 6: make demo's eval job warned that it "resumes from iteration 0").
    assert not [line for line in said if "resumes from iteration" in line], said

    on_disk = json.loads((run_dir / "eval" / "results.json").read_text())
    assert on_disk == json.loads(json.dumps(results))
    he = results["humaneval"]
    assert he["problems"] == 3 and set(he["pass_at"]) == {"pass@1", "pass@2"}
    assert [r["temperature"] for r in he["by_temperature"]] == [0.2, 0.8]
    for r in he["by_temperature"]:
        assert len(r["correct"]) == 3 and all(0 <= c <= 2 for c in r["correct"].values())
        assert sum(r["statuses"].values()) == 6
    assert he["generated_tokens"] > 0 and he["problems_per_minute"] > 0
    assert results["settings"]["stop_sequences"] == ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]
    assert results["model"] == str(hf_dir) and results["seconds"] > 0

    held = results["perplexity"]["heldout"]
    assert held["split"] == "valid" and held["samples"] == 6 and held["tokens"] == 6 * 64
    assert held["perplexity"] == pytest.approx(math.exp(held["loss"]))
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    assert 0.5 * math.log(model.config.vocab_size) < held["loss"] < 2 * math.log(model.config.vocab_size)
    assert results["perplexity"][str(extra)]["documents"] == 1

    card = (hf_dir / "README.md").read_text()
    assert card.count("## Evaluation") == 1 and "## Conversion check" in card and "| pass@1 |" in card
    assert "held-out valid split" in card
    run_eval(run)  # a second eval replaces its section instead of adding one
    assert (hf_dir / "README.md").read_text().count("## Evaluation") == 1

    files = run_files(str(run_dir))
    assert len(files) == 3 and {i for f in files for i in run_ids(f)} == {"evalrun1"}
    rows = [r for r in history(files[1]) if "eval/humaneval_pass_at_1" in r]
    assert len(rows) == 1 and rows[0]["_step"] == 6  # one step after the training's last
    assert rows[0]["eval/heldout_perplexity"] == pytest.approx(held["perplexity"])


def test_scoring_matches_transformers_own_loss(hf_dir, data_prefix, tmp_path):
    """The held-out loss is the mean next-token NLL transformers computes itself (labels=inputs)."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.eval.perplexity import HeldOut, heldout_perplexity

    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    data = HeldOut(data_prefix, "80,20,0", 32, cache_dir=str(tmp_path / "cache"))
    ours = heldout_perplexity(model, data, 1, torch.device("cpu"))
    from trainer.data.gpt_dataset import GPTDatasetConfig, SplitRequest, build_split
    from trainer.data.index_cache import IndexCacheConfig
    from trainer.data.indexed_dataset import IndexedDataset
    from trainer.data.splits import split_ranges

    src = IndexedDataset(data_prefix)
    ds = build_split(src, SplitRequest("valid", split_ranges("80,20,0", len(src.sizes))["valid"], None),
                     GPTDatasetConfig(seq_length=32, split="80,20,0"),
                     IndexCacheConfig(str(tmp_path / "cache"), True))
    row = torch.from_numpy(ds[0])[None]
    with torch.no_grad():
        theirs = model(row, labels=row).loss.item()
    assert ours["loss"] == pytest.approx(theirs, rel=1e-5)


def test_left_padding_gives_each_row_its_own_continuation(hf_dir):
    """Greedy completions of prompts of different lengths are the same alone and batched together."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.eval.generate import HFCompleter, SamplingConfig

    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tok = AutoTokenizer.from_pretrained(hf_dir)
    prompts = ["def f(x):\n    return", "import os\n\n\nclass Parser:\n    def parse(self, text):\n        "]
    batched = HFCompleter(model, tok, SamplingConfig(max_new_tokens=8, batch_size=2), torch.device("cpu"))
    alone = HFCompleter(model, tok, SamplingConfig(max_new_tokens=8, batch_size=1), torch.device("cpu"))
    assert tok.padding_side == "left"
    assert batched(prompts, 0.0) == alone(prompts, 0.0)


def test_code_execution_is_refused_without_consent(hf_dir, tmp_path):
    from trainer.config_issues import ConfigError

    consent = r"eval.allow_code_execution=False.*set eval.allow_code_execution=true"
    with pytest.raises(ConfigError, match=consent):
        EvalConfig(**{**SMOKE, "allow_code_execution": False})
    assert EvalConfig(**{**SMOKE, "allow_code_execution": False, "humaneval_problems": 0}).num_problems() == 0
    with pytest.raises(ConfigError, match="eval.n_samples=2"):
        EvalConfig(**{**SMOKE, "pass_at_k": [1, 10]})
    with pytest.raises(ConfigError, match="one temperature per entry"):
        EvalConfig(**{**SMOKE, "temperatures": [0.2]})


def test_the_command_line_refuses_without_consent_then_evaluates(hf_dir, data_prefix, tmp_path):
    import subprocess
    import sys

    from tests.orchestrator.conftest import REPO

    base = [sys.executable, "-m", "trainer.eval", "--hf-dir", str(hf_dir), "--out", str(tmp_path / "o"),
            "--problems", "2", "--samples", "1", "--pass-at-k", "1", "--temperatures", "0.2",
            "--max-new-tokens", "8", "--data-prefix", data_prefix, "--split", "80,20,0", "--seq-length", "32"]
    refused = subprocess.run(base, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "eval.allow_code_execution" in refused.stderr
    assert not (tmp_path / "o").exists()
    ran = subprocess.run(base + ["--allow-code-execution"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert json.loads(ran.stdout)["pass_at"] == {"pass@1": 0.0}  # a random model solves nothing
    assert json.loads((tmp_path / "o" / "results.json").read_text())["humaneval"]["problems"] == 2
