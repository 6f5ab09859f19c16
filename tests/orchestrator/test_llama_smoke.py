"""`+experiment=llama_smoke`: the whole pipeline on this machine with the Llama-style decoder (issue 16),
as the demo runs it for the GPT, on the demo test's smaller budget: corpus → tokenizer → preprocess →
training at tp=2 × pp=2 with grouped-query attention, rope, RMSNorm, SwiGLU and an untied head → convert
to ``LlamaForCausalLM`` with verification → the smoke eval, through ``transformers``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.record.launches import current, current_jobs
from orchestrator.stages.tune import NAME as TUNE
from tests.orchestrator.conftest import REPO, stage_names
from tests.orchestrator.test_demo import ITERS, SMALLER
from trainer.checkpoint.protocol import load_file, shard_path

STAGES = stage_names(TUNE)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("llama")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "launch.py", "+experiment=llama_smoke", f"runs_root={root}", *SMALLER]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    runs = list((root / "llama_smoke").iterdir())
    assert len(runs) == 1, runs
    return runs[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_llama_smoke_runs_every_stage_and_converts_to_llama(run):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    meta = json.loads((run / "run.json").read_text())
    assert set(current_jobs(meta)) == set(STAGES)
    for stage in STAGES:
        assert (Path(current(meta)["stages"][stage]["dir"]) / "_COMPLETE").exists() or \
            (run / "stages" / stage / "_COMPLETE").exists(), stage
    args = load_file(shard_path(str(run / "checkpoints"), ITERS, 1, 1, 2))["args"]
    assert (args.swiglu, args.num_query_groups, args.normalization, args.position_embedding_type) == \
        (True, 2, "RMSNorm", "rope") and args.untie_embeddings_and_output_weights
    hf = run / "hf"
    assert not (hf / "INVALID").exists()
    model = AutoModelForCausalLM.from_pretrained(hf)
    assert isinstance(model, LlamaForCausalLM)
    c = model.config
    shape = (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads)
    assert shape == (4, 128, 4, 2)
    assert (c.tie_word_embeddings, c.intermediate_size) == (False, 256)
    assert json.loads((hf / "config.json").read_text())["rope_theta"] == 500000.0
    tok = AutoTokenizer.from_pretrained(hf)
    ids = tok("def main():\n    return 0\n", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    results = json.loads((run / "eval" / "results.json").read_text())
    assert results["model"] == str(hf) and results["humaneval"]["problems"] == 4
    assert results["perplexity"]["heldout"]["tokens"] > 0
