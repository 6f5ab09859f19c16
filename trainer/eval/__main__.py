"""``python -m trainer.eval --hf-dir D --out O [--problems N --samples N ...] --allow-code-execution``:
the eval stage's work on any Hugging Face GPT folder, without the launcher."""

from __future__ import annotations

import argparse
import json
import sys

from trainer.checks import ConfigError
from trainer.data.splits import DEFAULT_SPLIT
from trainer.eval.config import EvalConfig
from trainer.eval.run import EvalRun, run_eval


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.eval", description=__doc__)
    p.add_argument("--hf-dir", required=True, help="a transformers causal-LM folder (e.g. <run_dir>/hf)")
    p.add_argument("--out", required=True, help="folder for results.json")
    p.add_argument("--problems", type=int, default=None, help="first N HumanEval problems (default: all 164)")
    p.add_argument("--samples", type=int, default=200, help="samples per problem and temperature")
    p.add_argument("--pass-at-k", type=int, nargs="+", default=[1, 10, 100])
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.2, 0.6, 0.8])
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--device", default="cpu")
    p.add_argument("--data-prefix", default=None, help="a .bin/.idx prefix: perplexity on its held-out split")
    p.add_argument("--split", default=DEFAULT_SPLIT, help="the training's data.split")
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--jsonl", nargs="*", default=[], help="JSONL files whose perplexity is reported")
    p.add_argument("--allow-code-execution", action="store_true",
                   help="run the model's programs in the sandbox (required for HumanEval)")
    a = p.parse_args(argv)
    try:
        settings = EvalConfig(enabled=True, humaneval_problems=a.problems, n_samples=a.samples,
                              pass_at_k=a.pass_at_k, temperatures=a.temperatures,
                              max_new_tokens=a.max_new_tokens, batch_size=a.batch_size, device=a.device,
                              allow_code_execution=a.allow_code_execution, perplexity_files=a.jsonl)
    except ConfigError as e:  # e.g. HumanEval without --allow-code-execution: say which flag
        sys.stderr.write(f"{e}\n(on this command line: --allow-code-execution, --problems 0, --samples)\n")
        return 2
    results = run_eval(EvalRun(a.hf_dir, a.out, settings, a.data_prefix, a.split, a.seq_length))
    ppl = {k: v["perplexity"] for k, v in results["perplexity"].items() if v}
    summary = {"pass_at": results.get("humaneval", {}).get("pass_at"), "perplexity": ppl,
               "results": f"{a.out}/results.json"}
    sys.stdout.write(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
