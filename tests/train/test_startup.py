"""Start-up after a requeue does only what a resume needs: the weights a checkpoint is about to replace
are not initialised first (the exact-resume tests, test_resume.py and test_faults.py, show the resumed run
is the uninterrupted one bit for bit), and the attempt's record names each phase it went through."""

from __future__ import annotations

import pytest

from tests.train.harness import run_cfg, tiny_config, write_dataset
from trainer.goodput import read_records
from trainer.signals import EXIT_OK


def test_a_resume_does_not_initialise_the_weights_it_loads(tmp_path, monkeypatch):
    import trainer.parallel.engine as engine

    data = write_dataset(str(tmp_path / "data"))
    d = tiny_config(str(tmp_path / "run"), data, train={"iters": 2, "save_interval": 2})
    calls = []
    real = engine.init_weights
    monkeypatch.setattr(engine, "init_weights", lambda *a: (calls.append(1), real(*a)))
    assert run_cfg(d).exit_code == EXIT_OK and calls  # a fresh start initialises
    monkeypatch.setattr(engine, "init_weights", lambda *a: pytest.fail("a resume initialised weights"))
    d["train"]["iters"] = 4
    assert run_cfg(d).exit_code == EXIT_OK
    fresh, resumed = read_records(str(tmp_path / "run"))
    assert fresh["load"] is None and resumed["load"]["iteration"] == 2 and resumed["load"]["bytes"] > 0
    # The load is timed inside its phase (not compared with the fresh attempt's near-zero phase: on a loaded
    # machine that one can take longer than a tiny checkpoint's load, which made the comparison flaky).
    assert resumed["seconds"]["checkpoint_load"] + 1e-4 >= resumed["load"]["seconds"] > 0
    assert {"imports", "build", "data", "first_step"} <= set(resumed["seconds"])
