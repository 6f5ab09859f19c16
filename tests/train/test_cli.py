"""``python -m trainer.main --config resolved.yaml``: a real SIGTERM (twice, the second arriving while the
first is being handled) stops the run cleanly with the requeue exit code; running the same command again
resumes and finishes with exactly the losses of an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time

import yaml

from tests.train.harness import run_cfg, tiny_config, write_dataset
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
    cmd = [sys.executable, "-m", "trainer.main", "--config", str(cfg_file)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    metrics = tmp_path / "run" / "train_metrics.jsonl"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 180
    while not _rows(metrics) or max(_rows(metrics)) < 3:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)  # a second signal must not break the stop or the save
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == EXIT_REQUEUE, out[-3000:]
    stopped_at = ckpt.read_tracker(str(tmp_path / "run" / "checkpoints"))
    assert 3 <= stopped_at < ITERS and f"checkpoint saved at iteration {stopped_at}" in out

    resumed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert resumed.returncode == EXIT_OK, resumed.stderr[-3000:]
    assert f"iteration {stopped_at}" in resumed.stderr
    logged = _rows(metrics)
    assert sorted(logged) == list(range(1, ITERS + 1))
    assert logged == straight.losses
