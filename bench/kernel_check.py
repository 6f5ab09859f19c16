"""What the start-up kernel self-check (``train.kernel_check``, trainer/ops/selfcheck.py) costs.

1. Warm, in this process: ``run_check`` on the csrc kernel set at the widths of the smoke model (tp=2),
   CodeParrot-small and the Llama preset used by the tests, fp32 and bf16 (bf16 checks both activation
   dtypes), median of 15 after one warm-up — beside one forward + backward of the smoke model
   (micro-batch 8 × 128, the demo's) measured in the same run: the check's cost in micro-batches.
2. Cold, as a job pays it: fresh processes train the smoke model (one process, fp32, csrc) to the end of
   iteration 1 with ``train.kernel_check=fallback`` and with ``off``, alternating; the time from
   ``trainer.run.run`` to the end of step 1, medians. The difference is what a job pays, first-use
   costs (autograd and kernel warm-up the first step would otherwise pay) included.

    python bench/kernel_check.py [--device cpu|cuda] [--runs 5] [--threads 1] [--out DIR]
    # writes DIR/kernel_check_<device>.json (default bench/results)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.meta import run_meta  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SMOKE = dict(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128, vocab_size=8192)
CODEPARROT = dict(vocab_size=32768)
LLAMA = dict(num_layers=2, hidden_size=96, num_attention_heads=6, num_query_groups=2, seq_length=64,
             vocab_size=300, position_embedding="rope", normalization="rmsnorm", activation="swiglu")
MODELS = {"smoke (tp=2)": (SMOKE, 2), "codeparrot-small": (CODEPARROT, 1), "llama (tests, tp=2)": (LLAMA, 2)}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def warm(device: str, repeats: int = 15) -> dict:
    from trainer.config import ModelConfig
    from trainer.ops import resolve
    from trainer.ops.selfcheck import CheckSetup, run_check
    from trainer.ops.selfcheck_cases import CheckShapes

    out = {}
    kernels = resolve("csrc", device)
    for name, (fields, tp) in MODELS.items():
        model = ModelConfig(**fields)
        shapes = CheckShapes.for_model(model, tp, model.padded_vocab_size(tp))
        for label, dtypes in (("fp32", (torch.float32,)), ("bf16", (torch.bfloat16, torch.float32))):
            setup = CheckSetup(torch.device(device), dtypes, torch.float32, shapes)
            times = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                check = run_check(kernels, setup, "fallback")
                _sync(device)
                times.append(time.perf_counter() - t0)
            assert not check.fallbacks, check.fallbacks
            out[f"{name} {label}"] = {"median_s": statistics.median(times[1:]), "min_s": min(times[1:]),
                                      "ops": len(check.results)}
    return out


def micro_batch_seconds(device: str, repeats: int = 15) -> float:
    """One forward + backward of the smoke model, micro-batch 8 × 128, csrc kernels (median)."""
    from trainer.config import ModelConfig
    from trainer.model.gpt import build_gpt, masked_mean

    model = build_gpt(ModelConfig(**SMOKE), seed=1, device=device, kernels="csrc").train()
    tokens = torch.randint(0, 8192, (8, 128), device=device)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        masked_mean(model(tokens, labels=tokens)).backward()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


_CHILD = """
import sys, time
import torch
torch.set_num_threads({threads})
sys.path.insert(0, {root!r})
from tests.train.harness import run_cfg, tiny_config
from trainer.run import RunHooks
marks = {{}}
cfg = tiny_config({run_dir!r}, {data!r}, model={model!r}, kernels="csrc",
                  train={{"iters": 1, "micro_batch_size": 8, "global_batch_size": 8, "eval_interval": None,
                         "device": {device!r}, "kernel_check": {policy!r}}})
t0 = time.perf_counter()
run_cfg(cfg, RunHooks(on_step=lambda it, loss: marks.setdefault(it, time.perf_counter())))
print("TO_FIRST_STEP", marks[1] - t0)
"""


def cold(device: str, runs: int, threads: int) -> dict:
    from tests.train.harness import write_dataset

    root = str(Path(__file__).resolve().parents[1])
    times: dict[str, list[float]] = {"fallback": [], "off": []}
    with tempfile.TemporaryDirectory() as tmp:
        data = write_dataset(f"{tmp}/data", n_docs=400)
        model = {**SMOKE, "vocab_size": 200, "hidden_dropout": 0.0, "attention_dropout": 0.0}
        for i in range(runs):
            for policy in ("fallback", "off") if i % 2 == 0 else ("off", "fallback"):
                code = _CHILD.format(root=root, run_dir=f"{tmp}/run-{policy}-{i}", data=data, model=model,
                                     device=device, policy=policy, threads=threads)
                out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
                line = next(x for x in out.stdout.splitlines() if x.startswith("TO_FIRST_STEP"))
                times[policy].append(float(line.split()[1]))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"runs": times, "median_s": med, "added_s": med["fallback"] - med["off"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--runs", type=int, default=5, help="cold runs per arm (0: warm figures only)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads (1: as the tests and a shared machine; tiny ops contend)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = {"meta": run_meta(), "device": args.device, "torch": torch.__version__,
              "threads": torch.get_num_threads()}
    result["micro_batch_s"] = micro_batch_seconds(args.device)
    result["warm"] = warm(args.device)
    print(f"one smoke-model micro-batch (fwd+bwd, 8 x 128): {1e3 * result['micro_batch_s']:.1f} ms")
    for name, row in result["warm"].items():
        print(f"warm check {name:<28} {row['ops']} ops  median {1e3 * row['median_s']:7.1f} ms  "
              f"= {row['median_s'] / result['micro_batch_s']:.2f} micro-batches")
    if args.runs:
        result["cold"] = cold(args.device, args.runs, args.threads)
        c = result["cold"]
        print(f"cold, time to the end of step 1: check {c['median_s']['fallback']:.3f} s, off "
              f"{c['median_s']['off']:.3f} s, added {c['added_s']:+.3f} s (medians of {args.runs})")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"kernel_check_{args.device}.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
