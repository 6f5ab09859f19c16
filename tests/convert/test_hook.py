"""The post-job hook: <run_dir>/checkpoints → <run_dir>/hf + sample.txt; push_to_hub fails fast here."""

from __future__ import annotations

import json

import pytest

from tests.convert.conftest import make_checkpoint
from trainer.convert import ConvertRunConfig, HubUnavailable, convert_run


def _run_dir(tmp_path, tokenizer_dir):
    run = tmp_path / "runs" / "smoke" / "r1"
    run.mkdir(parents=True)
    ckpt, _, _ = make_checkpoint(run, tokenizer_dir, 2, 1)
    ckpt.rename(run / "checkpoints")
    (run / "run.json").write_text(json.dumps({"run_id": "20260101-abc", "experiment": "smoke"}))
    return run


def test_convert_run_writes_verified_hf_and_sample(tmp_path, tokenizer_dir):
    run = _run_dir(tmp_path, tokenizer_dir)
    rows = [{"iteration": 100, "lm loss": 3.0}, {"iteration": 100, "valid/lm_loss": 2.75},
            {"iteration": 150, "valid/lm_loss": 2.5}, {"iteration": 200, "valid/lm_loss": 2.0}]
    (run / "train_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"iter')
    result = convert_run(run, ConvertRunConfig(prompt="import os\n", sample_tokens=12))
    assert result.report.passed and result.output_dir == run / "hf"
    assert (run / "hf" / "config.json").is_file() and not (run / "hf" / "INVALID").exists()
    sample = (run / "sample.txt").read_text()
    assert "import os\n" in sample and len(sample.splitlines()) >= 2
    card = (run / "hf" / "README.md").read_text()
    assert "20260101-abc" in card and "| final validation loss | 2.5000 |" in card  # at iteration 150
    assert result.provenance.val_loss == 2.5
    # The orchestrator's call (keyword fields, verify flag), rerun over an existing hf/.
    again = convert_run(str(run), checkpoint_dir=str(run / "checkpoints"), output_dir=str(run / "hf"),
                        vocab_file=str(tokenizer_dir / "vocab.json"),
                        merge_file=str(tokenizer_dir / "merges.txt"), verify=True)
    assert again.report.passed and "verification PASSED" in str(again)


def test_push_to_hub_fails_fast_without_token(tmp_path, tokenizer_dir, monkeypatch):
    run = _run_dir(tmp_path, tokenizer_dir)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # no stored login either
    with pytest.raises(HubUnavailable, match="no Hugging Face token"):
        convert_run(run, push_to_hub=True, hub_repo="someone/model")
    assert not (run / "hf").exists() and not (run / "sample.txt").exists()  # no partial work


def test_push_to_hub_fails_fast_without_network(tmp_path, tokenizer_dir, monkeypatch):
    run = _run_dir(tmp_path, tokenizer_dir)
    monkeypatch.setenv("HF_TOKEN", "hf_dummy_token_for_the_test")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: like a cluster without network
    with pytest.raises(HubUnavailable, match="cannot reach http://127.0.0.1:9"):
        convert_run(run, push_to_hub=True, hub_repo="someone/model")
    assert not (run / "hf").exists()
    with pytest.raises(ValueError, match="hub_repo"):
        ConvertRunConfig(push_to_hub=True)
