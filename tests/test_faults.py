"""A real job names every active test-only hook in a warning at start-up (trainer/faults.py)."""

from __future__ import annotations

import logging

from tests.logs import LogLines
from tests.train.harness import run_cfg, tiny_config, write_dataset
from trainer import faults


def test_trainer_warns_for_each_active_hook(tmp_path, monkeypatch):
    values = {faults.CKPT_FAILPOINT: "mid_write@999", faults.CKPT_FAILPOINT_ONCE:
              str(tmp_path / "once"), faults.PREFLIGHT_FAILPOINT: "slow@nowhere:1",
              faults.NODE_NAME: "node-under-test", faults.KERNEL_FAULT: "bias_gelu",
              faults.LAUNCH_FAILPOINT: "after_sbatch",  # launch- and stage-side: named, not acted on
              faults.CONVERT_FAILPOINT: "between_renames",  # the convert stage's: named here, not acted on
              faults.FAIL_TRAIN: "start", faults.STALL_TRAIN: "999", faults.CRASH_TRAIN: "999",
              faults.FAIL_TRIAL: "99"}  # a trial index this run is not
    assert set(values) == set(faults.ENV_HOOKS)
    for k, v in values.items():
        monkeypatch.setenv(k, v)
    records = LogLines()
    logging.getLogger("slipway").addHandler(records)
    try:
        data = write_dataset(str(tmp_path / "data"))
        run_cfg(tiny_config(str(tmp_path / "run"), data, train={"iters": 1, "save_interval": 1}))
    finally:
        logging.getLogger("slipway").removeHandler(records)
    warned = [line for line in records.lines if line.startswith("TEST HOOK ACTIVE: ")]
    assert len(warned) == len(values), records.lines
    for k, v in values.items():
        assert any(line.startswith(f"TEST HOOK ACTIVE: {k}={v} (") for line in warned), warned
