"""Start-up after a requeue (issue 53): where a resumed attempt's time to its first step goes, phase by
phase (its goodput record), and what keeping torch.compile's cache in the run directory saves.

Three attempts of one ``kernels=compile_layer`` run of the smoke-sized GPT (``python -m trainer.run``, the
standalone trainer), each in a fresh TMPDIR, as a requeued job on another node (or any job with a
job-private /tmp) starts:

1. the first attempt trains 2 iterations (it compiles; the run directory's cache fills);
2. *before*: a resume with ``TORCHINDUCTOR_CACHE_DIR`` in its own fresh TMPDIR, which is where Inductor's
   default put it until now: it compiles again;
3. *after*: a resume with the default now (the run's ``compile_cache``): it finds the compiled graphs.

    python bench/startup.py     # results/startup.json (about 10 minutes on 2 busy cores)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.meta import ROOT, load, run_meta  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "startup.json"
MODEL = {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "seq_length": 128,
         "max_position_embeddings": 128}


def config(root: Path) -> Path:
    import yaml

    from tests.train.harness import tiny_config, write_dataset

    data = write_dataset(str(root / "data"))
    d = tiny_config(str(root / "run"), data, model=MODEL, kernels="compile_layer",
                    train={"micro_batch_size": 2, "global_batch_size": 2, "iters": 2, "save_interval": 2,
                           "log_interval": 1, "eval_interval": None})
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


def attempt(cfg: Path, iters: int, env: dict) -> dict:
    """One trainer process to ``iters``; its goodput record (the newest)."""
    from trainer.goodput import read_records

    out = subprocess.run([sys.executable, "-m", "trainer.run", "--config", str(cfg), f"train.iters={iters}",
                          f"train.save_interval={iters}"], cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"trainer failed ({out.returncode}):\n{out.stderr[-3000:]}")
    rec = read_records(str(cfg.parent / "run"))[-1]
    return {"to_first_step_s": rec["first_step_end"] - rec["process_start"],
            "phases": {k: v for k, v in rec["seconds"].items() if v >= 0.005},
            "load": rec["load"], "start_iteration": rec["start_iteration"]}


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="slipway-startup-bench-"))
    cfg = config(root)
    base = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}

    def fresh_tmp() -> str:
        return tempfile.mkdtemp(prefix="tmp-", dir=root)

    result = {"meta": run_meta(), "model": MODEL, "kernels": "compile_layer"}
    result["first"] = attempt(cfg, 2, {**base, "TMPDIR": fresh_tmp()})
    tmp = fresh_tmp()
    result["before"] = attempt(cfg, 4, {**base, "TMPDIR": tmp, "TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor"})
    result["after"] = attempt(cfg, 6, {**base, "TMPDIR": fresh_tmp()})
    b, a = result["before"]["to_first_step_s"], result["after"]["to_first_step_s"]
    result["summary"] = {"to_first_step_before_s": b, "to_first_step_after_s": a, "after_over_before": a / b}
    result["meta"]["load_after"] = load()
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
