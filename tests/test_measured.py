"""The committed MFU figures (bench/results/mfu.json) and their torch-free reader (trainer.measured), and
bench/record_mfu.py's rows from a GPU run's result files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import record_mfu
from trainer.measured import LOOP, MFU_FILE, STEP, SWEEP, load_measured, measured_mfu
from trainer.time_formulas import gemm_size

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


SWEEP_LOG = "bench/results/gpu_check_20261204T131708Z.txt"


def test_the_micro_batch_sweep_is_recorded_from_its_log_and_the_fit_reproduces_it(tmp_path):
    """bench/train_gpu.py's search for the best micro-batch on the H200 (micro-batch 8, 16, 32, 64 at
    183.8, 244.4, 260.8, 270.3 TFLOP/s of 989) is in mfu.json as record_mfu --log writes it from the
    committed log; the curve the plan fits to it (least squares, x/(x + half) of a saturated MFU, x =
    tokens × hidden² / tp) reproduces each point within 6 % (the worst, micro-batch 16, is 5.4 % off: the
    measured curve bends more sharply than the form); the sweep's points never become the plan's figure
    (the A/B row at micro-batch 64, 27.3 %, measured over more steps, stays it)."""
    from orchestrator.base.measured import efficiency_curves, measured_figures

    path = tmp_path / "mfu.json"
    args = ["--log", str(REPO / SWEEP_LOG), "--source", SWEEP_LOG, "--mfu-file", str(path)]
    assert record_mfu.main(args) == 0
    recorded = load_measured(path)
    points = [(8, 0.1858), (16, 0.2471), (32, 0.2637), (64, 0.2733)]
    assert [(r.micro_batch, r.mfu) for r in recorded] == points
    assert recorded == [r for r in load_measured() if r.what == SWEEP]  # the committed rows are these
    assert record_mfu.main(["--log", str(REPO / "bench/results/stress.txt"), "--mfu-file", str(path)]) == 2
    (curve,) = efficiency_curves()
    assert curve.gpu == "H200-SXM-141GB" and curve.points == tuple((r.micro_batch, r.mfu) for r in recorded)
    for mb, mfu in curve.points:
        assert abs(curve.top * curve.efficiency(gemm_size(mb, 1024, 768)) / mfu - 1) < 0.06, mb
    # An independent least-squares fit of the same four points (scipy.optimize.curve_fit on the TFLOP/s):
    # 294.5 TFLOP/s at saturation, half at 4,393 tokens of 1024 × 768² (the rounded MFUs: 4,396).
    assert curve.top * 989 == pytest.approx(294.5, rel=2e-3)
    assert curve.tokens_at_half(768) == pytest.approx(4393, rel=2e-3)
    (figure,) = measured_figures()
    assert (figure.mfu, figure.size) == (0.273, gemm_size(64, 1024, 768)) and "bench step" in figure.what
