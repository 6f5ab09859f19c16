"""The live log stream of a local run and the closing summary (run directories as jobs leave them)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from orchestrator.readback.follow import LogFollower, failure_tails, log_path
from orchestrator.readback.summary import write_summary
from trainer.run_files import LOSS_PLOT, SUMMARY


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "runs" / "codeparrot_smoke" / "r1"
    (run / "jobs" / "train").mkdir(parents=True)
    convert_state = run / "stages" / "convert"
    convert_state.mkdir(parents=True)
    jobs = {
        "train": [{"job_id": "41", "executor": "local", "folder": str(run / "jobs" / "train")}],
        "convert": [{"job_id": "42", "executor": "local", "folder": str(run / "jobs" / "convert")}],
    }
    meta = {"run_id": "r1", "jobs": jobs, "stages": {"convert": {"key": "k", "dir": str(convert_state)}}}
    (run / "run.json").write_text(json.dumps(meta))
    return run


def test_follower_streams_complete_lines_and_bar_redraws_once_each(tmp_path):
    run = _run_dir(tmp_path)
    out = io.StringIO()
    follow = LogFollower(str(run), out)
    follow.poll()  # no log yet: nothing, no error
    assert out.getvalue() == ""
    log = log_path(str(run / "jobs" / "train"), "41")
    log.write_bytes(b"[rank0] iteration 10 loss 7.1\n[rank0] iteration 2")
    (run / "jobs" / "train" / "41_1_log.err").write_text("rank 1 repeats everything\n")
    follow.poll()
    text = out.getvalue()
    assert text.count("──── train (job 41") == 1 and text.endswith("iteration 10 loss 7.1\n")
    assert "rank 1" not in text and "iteration 2" not in text  # only task 0; only whole lines
    with open(log, "ab") as f:
        f.write(b"0 loss 6.5\nbar  50%\rbar 100%")
    follow.poll()
    follow.poll()
    # The held partial line comes whole, then up to the last \r; nothing twice.
    assert out.getvalue()[len(text):] == "[rank0] iteration 20 loss 6.5\nbar  50%\r"
    assert out.getvalue().count("──── train") == 1


def test_failure_tails_show_every_task_of_the_failed_stages(tmp_path):
    run = _run_dir(tmp_path)
    folder = run / "jobs" / "train"
    (folder / "41_0_log.err").write_text("\n".join(f"line {i}" for i in range(40)) + "\n")
    (folder / "41_3_log.err").write_text("RuntimeError: rank 3 broke\n")
    text = failure_tails(str(run), ["train", "convert"], lines=5)
    assert "line 39" in text and "line 34" not in text and "line 35" in text
    assert "RuntimeError: rank 3 broke" in text and "41_3_log.err" in text


def test_summary_names_every_output_and_draws_the_loss_curve(tmp_path):
    run = _run_dir(tmp_path)
    rows = [{"iteration": i, "train/lm_loss": 7.6 - i / 100} for i in range(10, 310, 10)]
    rows += [{"iteration": 100, "valid/lm_loss": 6.5}, {"iteration": 300, "valid/lm_loss": 4.9}]
    rows += [{"iteration": 300, "train/lm_loss": 4.5}]  # replayed after a restart: the last one wins
    (run / "train_metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{cut")
    (run / "hf").mkdir()
    verdict = f"{run / 'hf'}: verification PASSED: max |Δlogit| = 1e-07"
    (run / "stages" / "convert" / "_COMPLETE").write_text(
        json.dumps({"result": {"hf": str(run / "hf"), "result": verdict}})
    )
    header = "# sample (greedy, repetition penalty 1.3) from hf (8 new tokens)"
    (run / "sample.txt").write_text(f"{header}\ndef fibonacci(n):\n    return n\n")
    (run / "wandb_run.json").write_text(json.dumps({"id": "r1", "last_step": 300}))
    offline = run / "wandb" / "offline-run-20260101_000000-r1"
    offline.mkdir(parents=True)

    text = write_summary(str(run), elapsed_s=200.0)
    assert (run / SUMMARY).read_text() == text
    assert (run / LOSS_PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"run directory    {run}" in text and "3.3 min" in text
    assert "train loss       4.500 (iteration 300), from 7.500 at iteration 10" in text
    assert "validation loss  4.900 (iteration 300)" in text
    assert f"HF model         {run / 'hf'}" in text and "verification PASSED" in text
    assert "sample           def fibonacci(n):\n                       return n\n" in text
    assert "(greedy, repetition penalty 1.3;" in text
    assert f"wandb sync {offline}" in text


def test_summary_of_a_run_without_outputs_says_so(tmp_path):
    run = _run_dir(tmp_path)
    text = write_summary(str(run))
    assert "train loss       n/a" in text and "no conversion" in text and not (run / LOSS_PLOT).exists()
