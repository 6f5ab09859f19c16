"""``python -m trainer.run --config resolved.yaml``: a real SIGTERM (twice, the second arriving while the
first is being handled) stops the run cleanly with the requeue exit code; running the same command again
resumes and finishes with exactly the losses of an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from tests.train.harness import run_cfg, tiny_config, write_dataset
from tests.waits import JOB_S, NEVER_S, wait_until
from trainer.checkpoint import protocol as ckpt
from trainer.signals import EXIT_OK, EXIT_REQUEUE

ITERS = 60


def _rows(path) -> dict[int, float]:
    """Last logged loss per iteration (a restart may log replayed iterations again)."""
    out = {}
    if os.path.exists(path):
        for line in open(path):
            row = json.loads(line)
            if "train/lm_loss" in row:
                out[row["iteration"]] = row["train/lm_loss"]
    return out


def test_sigterm_then_requeue(tmp_path):
    data = write_dataset(str(tmp_path / "data"))
    train = {"iters": ITERS, "log_interval": 1}
    straight = run_cfg(tiny_config(str(tmp_path / "straight"), data, train=train))
    d = tiny_config(str(tmp_path / "run"), data, train=train)
    cfg_file = tmp_path / "resolved.yaml"
    cfg_file.write_text(yaml.safe_dump({**d, "cluster": {"nodes": 1}, "container": {"kind": "none"},
                                        "dry_run": False, "wait": False}))
    cmd = [sys.executable, "-m", "trainer.run", "--config", str(cfg_file)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    metrics = tmp_path / "run" / "train_metrics.jsonl"
    # The same CLI, paused after iteration 3 until a signal comes: the signals land mid-run by
    # construction, not because this test outran a fast trainer.
    stalled = [sys.executable, str(Path(__file__).parent / "stalled_main.py"), "3", str(tmp_path), *cmd[3:]]
    proc = subprocess.Popen(stalled, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wait_until(lambda: (tmp_path / "stalled_3_rank0").exists() or proc.poll() is not None, "iteration 3")
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)  # a second signal must not break the stop or the save
    out = proc.communicate(timeout=NEVER_S)[0]
    assert proc.returncode == EXIT_REQUEUE, out[-3000:]
    stopped_at = ckpt.read_tracker(str(tmp_path / "run" / "checkpoints"))
    assert stopped_at == 3 and "checkpoint saved at iteration 3" in out, out[-3000:]

    resumed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=JOB_S)
    assert resumed.returncode == EXIT_OK, resumed.stderr[-3000:]
    assert f"iteration {stopped_at}" in resumed.stderr
    logged = _rows(metrics)
    assert sorted(logged) == list(range(1, ITERS + 1))
    assert logged == straight.losses
