"""The real training loop, as a launch runs it: ``python -m trainer.run --config ...`` on one device, on a
dataset of random tokens, reporting what its own log lines measure (train_metrics.jsonl: ms per
iteration, tokens/s, TFLOP/s, MFU, peak memory).

    python bench/loop_gpu.py --model codeparrot_small --micro-batch 12 --accumulate 2   # the experiment's
    python bench/loop_gpu.py --model codeparrot_small --micro-batch 64
    python bench/loop_gpu.py --device cpu --model gpt_tiny --micro-batch 2 --log-interval 2   # rehearsal

The run trains until its log has ``--intervals`` log lines and is then killed (SIGKILL: no checkpoint is
written, so a 1.3B model costs no 20 GB save); the figures are the last interval's (the first one also
holds the start-up: the kernel check, compilation, the allocator's warm-up). ``--accumulate`` micro-
batches per step: the CodeParrot experiment's 192 sequences on 8 GPUs at micro-batch 12 are 2 per GPU.
The start-up lines naming the precision recipe and the attention kernel are copied into the output;
--out writes loop_<model>_mb<micro>x<accumulate>_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.gpt_step import model_section  # noqa: E402
from bench.meta import run_meta  # noqa: E402

START_LINES = ("precision: ", "attention: ", "kernels=", "kernel self-check", "optimizer: ")


def random_dataset(folder: str, vocab: int, tokens: int, doc: int = 4096) -> str:
    """A Megatron .bin/.idx of ``tokens`` random token ids in documents of ``doc`` (built once)."""
    from trainer.data.indexed_dataset import IndexedDatasetBuilder

    prefix = os.path.join(folder, f"random_{vocab}_{tokens}_content_document")
    if os.path.exists(prefix + ".idx"):
        return prefix
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16 if vocab <= 65535 else np.int32)
    for _ in range(-(-tokens // doc)):
        builder.add_document(rng.integers(0, vocab - 1, doc))
    builder.finalize(prefix + ".idx")
    return prefix


def config(a: argparse.Namespace, prefix: str, run_dir: str) -> dict:
    model = model_section(a.model, a.vocab, sdpa_backend=a.sdpa_backend)
    if a.attention_dropout is not None:
        model["attention_dropout"] = a.attention_dropout
    return {"model": model, "kernels": a.kernels, "run_dir": run_dir,
            "data": {"paths": [prefix], "split": "100,0,0",
                     "cache_dir": os.path.join(run_dir, "index-cache")},
            "train": {"micro_batch_size": a.micro_batch, "global_batch_size": a.micro_batch * a.accumulate,
                      "iters": 10**6, "log_interval": a.log_interval, "eval_interval": None,
                      "precision": a.precision, "precision_recipe": a.recipe, "device": a.device,
                      "preflight": False},
            "checkpoint": {"dir": os.path.join(run_dir, "checkpoints"), "load": "none"},
            "logging": {"wandb": {"mode": "disabled"}}}


def perf_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if "perf/tokens_per_s" in r]


def run(a: argparse.Namespace, run_dir: str, prefix: str) -> tuple[list[dict], list[str], float]:
    """Start the trainer, wait for the log lines, kill it; (perf rows, start-up lines, seconds)."""
    cfg_path, log_path = os.path.join(run_dir, "config.yaml"), os.path.join(run_dir, "trainer.log")
    with open(cfg_path, "w", encoding="utf-8") as f:
        yaml.safe_dump(config(a, prefix, run_dir), f)
    metrics = os.path.join(run_dir, "train_metrics.jsonl")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen([sys.executable, "-m", "trainer.run", "--config", cfg_path], cwd=REPO,
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while len(perf_rows(metrics)) < a.intervals and proc.poll() is None:
                if time.perf_counter() - t0 > a.timeout_s:
                    break
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # no final checkpoint: a benchmark, not a run
            proc.wait()
    with open(log_path, encoding="utf-8") as f:
        text = f.read().splitlines()
    start = [line.split("] ", 1)[-1] for line in text if any(k in line for k in START_LINES)]
    rows = perf_rows(metrics)
    if len(rows) < a.intervals:
        sys.stderr.write("\n".join(text[-30:]) + "\n")
    return rows, start, time.perf_counter() - t0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", default="codeparrot_small", help="hydra_conf/model/<name>.yaml")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--micro-batch", type=int, default=12)
    ap.add_argument("--accumulate", type=int, default=1, help="micro-batches per step")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--recipe", default="auto")
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--sdpa-backend", default="auto")
    ap.add_argument("--attention-dropout", type=float, default=None)
    ap.add_argument("--log-interval", type=int, default=10)
    ap.add_argument("--intervals", type=int, default=2, help="log lines to wait for (the last is reported)")
    ap.add_argument("--timeout-s", type=float, default=240.0)
    ap.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "slipway-bench-data"))
    ap.add_argument("--out", default=None, help="folder for the JSON result")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    seq = int(model_section(a.model, a.vocab)["seq_length"])
    need = (a.log_interval * a.intervals + 2) * a.micro_batch * a.accumulate * (seq + 1)
    prefix = random_dataset(a.data_dir, a.vocab, int(need * 1.2) + 10 * seq)
    run_dir = tempfile.mkdtemp(prefix="slipway-bench-loop-")
    rows, start, seconds = run(a, run_dir, prefix)
    drop = "" if a.attention_dropout is None else f" attn-drop {a.attention_dropout}"
    label = (f"{a.model} mb{a.micro_batch}x{a.accumulate} {a.precision} recipe={a.recipe} "
             f"kernels={a.kernels} sdpa={a.sdpa_backend}{drop}")
    print(f"python -m trainer.run: {label}")
    for line in start:
        print(f"  | {line}")
    if len(rows) < a.intervals:
        print(f"  FAILED: {len(rows)} of {a.intervals} log lines in {seconds:.0f} s "
              f"(log: {run_dir}/trainer.log)")
        return 1
    r = rows[-1]
    mfu = f"{100 * r['perf/mfu']:.1f}%" if "perf/mfu" in r else "-"
    print(f"  iteration {r['iteration']}: {r['perf/ms_per_iter']:.1f} ms/iter, {r['perf/tokens_per_s']:.0f} "
          f"tokens/s, {r['perf/tflops_per_gpu']:.1f} TFLOP/s, MFU {mfu}, peak {r['perf/peak_mem_gb']:.1f} "
          f"GB, lm loss {r.get('train/lm_loss', float('nan')):.3f} ({seconds:.0f} s in all)")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        name = f"loop_{a.model}_mb{a.micro_batch}x{a.accumulate}_{a.device}.json"
        with open(os.path.join(a.out, name), "w", encoding="utf-8") as f:
            json.dump({**run_meta(), "what": "trainer.run loop", "model": a.model, "args": vars(a),
                       "start_lines": start, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
