"""eval.device=cuda: the same eval on the GPU gives the CPU's perplexity and a well-formed HumanEval
result (sampling differs between devices, so only greedy agreement and shapes are compared)."""

from __future__ import annotations

import pytest

from tests.eval.test_run import SMOKE
from trainer.eval.config import EvalConfig
from trainer.eval.run import EvalRun, run_eval


@pytest.mark.gpu
def test_cuda_eval_matches_cpu_perplexity_and_greedy_completions(tmp_path, hf_dir, data_prefix):
    out = {}
    for device in ("cpu", "cuda"):
        settings = EvalConfig(**{**SMOKE, "device": device, "temperatures": [0.0, 0.8]})
        out[device] = run_eval(EvalRun(str(hf_dir), str(tmp_path / device), settings, data_prefix, "80,20,0",
                                       64, "content"))
    cpu, gpu = out["cpu"], out["cuda"]
    assert gpu["device"].startswith("cuda")
    loss = cpu["perplexity"]["heldout"]["loss"]
    assert gpu["perplexity"]["heldout"]["loss"] == pytest.approx(loss, rel=1e-3)
    greedy = [next(t for t in res["humaneval"]["by_temperature"] if t["temperature"] == 0.0)
              for res in (cpu, gpu)]
    assert greedy[0]["examples"] == greedy[1]["examples"]  # greedy decoding: same text on both devices
