"""``python -m trainer.eval --hf-dir D --out O [--problems N --samples N ...] --allow-code-execution``:
the eval stage's work on any Hugging Face GPT folder, without the launcher. Its flags are EvalRun's and
the eval section's fields (trainer.eval.config: the defaults live there)."""

from __future__ import annotations

import argparse
import json
import sys

from trainer.cli import Flags, add_dataclass_args, from_args
from trainer.config_issues import ConfigError
from trainer.eval.config import EvalConfig, EvalRun
from trainer.eval.run import run_eval

# The run's W&B record and the stage's own switch and time limit mean nothing here; the older flag
# spellings (--out, --data-prefix, --problems, --samples, --jsonl) stay what users and tests type.
FLAGS = (
    Flags(EvalRun, skip=frozenset({"settings", "run_dir", "run_id", "wandb"}),
          rename={"out_dir": "out", "heldout_prefix": "data-prefix"}),
    Flags(EvalConfig, skip=frozenset({"enabled", "time_limit_min"}),
          rename={"humaneval_problems": "problems", "n_samples": "samples", "perplexity_files": "jsonl"}),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.eval", description=__doc__)
    for flags in FLAGS:
        add_dataclass_args(p, flags)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    run_flags, settings_flags = FLAGS
    try:
        settings = from_args(settings_flags, a, enabled=True)
    except ConfigError as e:  # e.g. HumanEval without --allow-code-execution: say which flag
        flag = settings_flags.flag
        sys.stderr.write(f"{e}\n(on this command line: {flag('allow_code_execution')}, "
                         f"{flag('humaneval_problems')} 0, {flag('n_samples')})\n")
        return 2
    run = from_args(run_flags, a, settings=settings)
    results = run_eval(run)
    ppl = {k: v["perplexity"] for k, v in results["perplexity"].items() if v}
    summary = {"pass_at": results.get("humaneval", {}).get("pass_at"), "perplexity": ppl,
               "results": f"{run.out_dir}/results.json"}
    sys.stdout.write(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
