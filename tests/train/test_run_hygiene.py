"""Small things a user meets: identical runs save identical RNG states (NumPy's and Python's global
generators are seeded from the run's seed); a restart logs the replayed iterations once, not twice; the
standalone trainer turns an error a retry would repeat (a damaged dataset) into exit 78 and its message."""

import json
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch
import yaml

from tests.train.harness import run_cfg, tiny_config, write_dataset
from tests.waits import NEVER_S
from trainer.checkpoint import protocol as ckpt
from trainer.metrics_file import TRAIN_LOSS, VALID_LOSS, metrics_path
from trainer.run import RunHooks
from trainer.signals import EXIT_OK, EXIT_PERMANENT


def _trainer(cfg: dict, tmp_path, name: str) -> subprocess.Popen:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "trainer.run", "--config", str(path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_identical_runs_save_identical_rng_states(tmp_path):
    """Two processes (a process's unseeded generators start from OS entropy), same config and seed."""
    data = write_dataset(str(tmp_path / "data"))
    procs = [_trainer(tiny_config(str(tmp_path / name), data, train={"iters": 3, "save_interval": 3}),
                      tmp_path, name) for name in ("a", "b")]
    for p in procs:
        out = p.communicate(timeout=NEVER_S)[0]
        assert p.returncode == EXIT_OK, out[-3000:]
    a, b = (ckpt.load_file(ckpt.shard_path(str(tmp_path / name / "checkpoints"), 3, 0, 0, 1))["rng_state"][0]
            for name in ("a", "b"))
    assert a["random_rng_state"] == b["random_rng_state"]
    for x, y in zip(a["np_rng_state"], b["np_rng_state"], strict=True):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    assert torch.equal(a["torch_rng_state"], b["torch_rng_state"])


def test_a_restart_logs_each_replayed_iteration_once(tmp_path):
    data = write_dataset(str(tmp_path / "data"))
    train = {"iters": 30, "save_interval": 10, "eval_interval": 10}
    d = tiny_config(str(tmp_path / "run"), data, train=train)

    def crash_at_27(it: int, loss: float) -> None:  # after logging 25; the last checkpoint is 20
        if it == 27:
            raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        run_cfg(d, RunHooks(on_step=crash_at_27))
    assert run_cfg(d).exit_code == EXIT_OK  # the retry: resumes from 20, logs 21..30
    rows = [json.loads(line) for line in open(metrics_path(str(tmp_path / "run")))]
    for kind in (TRAIN_LOSS, VALID_LOSS):
        counts = Counter(r["iteration"] for r in rows if kind in r)
        assert counts and set(counts.values()) == {1}, (kind, counts)
    assert sorted(r["iteration"] for r in rows if TRAIN_LOSS in r) == [5, 10, 15, 20, 25, 30]


def test_standalone_trainer_exits_78_with_the_dataset_error(tmp_path):
    data = write_dataset(str(tmp_path / "data"))
    with open(data + ".idx", "r+b") as f:  # a damaged index header
        f.write(b"NOTMAGIC!")
    p = _trainer(tiny_config(str(tmp_path / "run"), data), tmp_path, "run")
    out = p.communicate(timeout=NEVER_S)[0]
    assert p.returncode == EXIT_PERMANENT, out[-3000:]
    assert "IndexedDatasetError: " in out and data + ".idx" in out and "Traceback" not in out, out[-3000:]
