"""``python -m trainer.run --config X.yaml`` with a hand-written YAML: YAML 1.2 floats (``lr: 3e-4``,
which PyYAML's YAML 1.1 reads as a string) work as under Hydra, and a configuration problem (here a
pp_size that does not divide the layers) is one clear error and exit 78 (EXIT_PERMANENT), before any
rank starts, not a traceback."""

from __future__ import annotations

import subprocess
import sys

import yaml

from tests.train.harness import tiny_config, write_dataset
from trainer.config import RunConfig
from trainer.signals import EXIT_OK, EXIT_PERMANENT


def _yaml(tmp_path, **sections) -> str:
    d = tiny_config(str(tmp_path / "run"), write_dataset(str(tmp_path / "data")), **sections)
    d["optim"]["lr"], d["optim"]["min_lr"] = 12345.0, 0.0
    text = yaml.safe_dump(d).replace("lr: 12345.0", "lr: 3e-4")  # as a person writes it
    assert yaml.safe_load(text)["optim"]["lr"] == "3e-4"  # PyYAML: a string
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def _main(path: str, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.run", "--config", path, *overrides],
                          capture_output=True, text=True, timeout=300)


def test_yaml_1_2_floats_are_floats(tmp_path):
    path = _yaml(tmp_path, train={"iters": 1, "eval_interval": None, "global_batch_size": 2,
                                  "micro_batch_size": 2})
    assert RunConfig.from_yaml(path).optim.lr == 3e-4
    proc = _main(path)
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]


def test_a_pp_that_does_not_divide_the_layers_is_one_config_error(tmp_path):
    proc = _main(_yaml(tmp_path), "model.num_layers=3", "parallel.pp_size=2")
    assert proc.returncode == EXIT_PERMANENT, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "1 configuration problem(s)" in proc.stderr
    assert "[pp_layers] parallel.pp_size=2: model.num_layers=3 is not divisible by it" in proc.stderr
