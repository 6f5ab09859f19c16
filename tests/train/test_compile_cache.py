"""torch.compile's cache lives in the run directory (trainer.run.kernels.use_run_compile_cache): a requeued
job on another node, or with a job-private /tmp, finds the compiled graphs instead of compiling again
(bench/goodput.py measures what that saves). Checked against torch's own resolution of the folder, in a
fresh interpreter (the environment and Inductor's import state are process-wide)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.train.harness import tiny_config, write_dataset
from tests.waits import NEVER_S
from trainer.run_files import RunDir

SCRIPT = """
import json, os, sys
import torch
torch.set_num_threads(1)
from tests.train.harness import run_cfg
run_cfg(json.loads(sys.argv[1]))
from torch._inductor.runtime.cache_dir_utils import cache_dir
print(json.dumps({"env": os.environ.get("TORCHINDUCTOR_CACHE_DIR"), "inductor": cache_dir(),
                  "imported": "torch._inductor" in sys.modules}))
"""


def _run(d: dict, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(d)], capture_output=True, text=True,
                         timeout=NEVER_S, env=env, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_run_directory_holds_inductors_cache_unless_the_job_names_one(tmp_path):
    data = write_dataset(str(tmp_path / "data"))
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    # train.deterministic imports torch._inductor at set-up, which settles the folder on first use: the
    # run's must be in place before that.
    d = tiny_config(str(tmp_path / "run"), data, train={"iters": 1, "deterministic": True})
    got = _run(d, {**env, "TMPDIR": str(tmp_path)})
    assert got["imported"] and got["inductor"] == got["env"] == str(RunDir(tmp_path / "run").compile_cache)


def test_a_folder_the_job_names_is_kept(tmp_path, monkeypatch):
    from trainer.run.kernels import use_run_compile_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "site-cache"))
    assert use_run_compile_cache(str(tmp_path / "run")) == str(tmp_path / "site-cache")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "site-cache")
