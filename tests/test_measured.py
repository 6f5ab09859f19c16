"""The committed MFU figures (bench/results/mfu.json) and their torch-free reader (trainer.measured), and
bench/record_mfu.py's rows from a GPU run's result files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import record_mfu
from trainer.measured import LOOP, MFU_FILE, STEP, load_measured, measured_mfu

REPO = Path(__file__).resolve().parents[1]


def test_committed_figures_name_their_date_commit_and_raw_output():
    rows = load_measured()
    assert rows, f"{MFU_FILE} holds no measurement"
    for r in rows:
        assert 0 < r.mfu < 1 and len(r.date) == 10 and r.commit and (REPO / r.source).is_file(), r
    h200 = measured_mfu("H200", num_layers=12, hidden_size=768)
    assert h200 is not None and h200.device == "NVIDIA H200" and h200.model == "codeparrot_small"
    assert "f24446f" in h200.describe() and "2026-12-04" in h200.describe()
    assert measured_mfu("A100") is None and measured_mfu("H100") is None  # never measured: no figure


def test_the_reader_imports_no_torch():
    code = "import sys, trainer.measured; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


def _ab(mfu: float, commit: str = "abc1234") -> dict:
    spec = {"precision": "bf16", "recipe": "autocast", "kernels": "csrc", "sdpa_backend": "auto",
            "attention_dropout": None}
    rows = {"baseline": {"spec": spec, "micro_batch": 64, "tokens_s": 5e5, "mfu": mfu, "peak_mem_gib": 25.0},
            "cpu_like": {"spec": spec, "micro_batch": 2, "tokens_s": 1.0, "mfu": None, "peak_mem_gib": None}}
    return {"date": "2027-01-05T10:00:00", "commit": commit, "device": "NVIDIA H200",
            "model": "codeparrot_small", "rows": rows}


def _loop(mfu: float) -> dict:
    args = {"micro_batch": 12, "accumulate": 2, "precision": "bf16", "recipe": "auto", "kernels": "auto",
            "sdpa_backend": "auto", "attention_dropout": None}
    return {"date": "2027-01-05T10:05:00", "commit": "abc1234", "model": "codeparrot_small", "args": args,
            "rows": [{"iteration": 20, "perf/tokens_per_s": 4e5, "perf/mfu": mfu, "perf/peak_mem_gb": 20.0}]}


def test_a_gpu_run_adds_rows_and_the_reader_prefers_the_real_loop(tmp_path):
    results, path = tmp_path / "results", tmp_path / "mfu.json"
    results.mkdir()
    (results / "ab_codeparrot_small_cuda.json").write_text(json.dumps(_ab(0.41)))
    (results / "loop_codeparrot_small_mb12x2_cuda.json").write_text(json.dumps(_loop(0.39)))
    args = ["--results", str(results), "--source", "bench/results/gpu_check_x.txt", "--mfu-file", str(path)]
    assert record_mfu.main([*args, "--device", "NVIDIA H200"]) == 0
    rows = load_measured(path)
    assert sorted(r.what for r in rows) == sorted([STEP, LOOP])  # the row without an MFU is not recorded
    best = measured_mfu("H200", 12, 768, path)
    assert best.what == LOOP and best.mfu == 0.39 and best.commit == "abc1234" and best.num_layers == 12
    (results / "ab_codeparrot_small_cuda.json").write_text(json.dumps(_ab(0.42)))
    record_mfu.main([*args, "--device", "NVIDIA H200"])  # a rerun at the same commit replaces its rows
    assert sorted(r.mfu for r in load_measured(path)) == [0.39, 0.42]
    assert measured_mfu("h200 sxm", 24, 2048, path) is not None  # another shape: the device's nearest model


def test_a_malformed_file_is_refused_naming_it(tmp_path):
    bad = tmp_path / "mfu.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="mfu.json"):
        load_measured(bad)
