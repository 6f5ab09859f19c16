"""The eval stage's work, standalone from one small dataclass: load ``<run_dir>/hf`` as users load it,
sample and execute HumanEval, score perplexity, then write ``<out_dir>/results.json``, add the figures to
the model card (``hf/README.md``) and log them to the run's W&B run (resumed from ``wandb_run.json``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

from trainer.eval.config import STOP_SEQUENCES, EvalConfig, EvalRun  # noqa: F401 (EvalRun: re-exported)
from trainer.eval.humaneval import evaluate, load_problems
from trainer.eval.results import RESULTS_FILE, flat_metrics
from trainer.eval.sandbox import Limits, isolation
from trainer.log import get_logger
from trainer.metrics_file import VALID_LOSS, series

log = get_logger(__name__)


def _humaneval(run: EvalRun, model, tok, device) -> dict[str, Any]:
    from trainer.eval.generate import HFCompleter, SamplingConfig

    s = run.settings
    problems = load_problems(s.num_problems())
    sampling = SamplingConfig(s.max_new_tokens, s.top_p, s.batch_size, s.seed)
    completer = HFCompleter(model, tok, sampling, device)
    limits = Limits(timeout_s=s.timeout_s, memory_mb=s.memory_mb)
    by_t: dict[float, list[int]] = {}
    for k, t in zip(s.pass_at_k, s.temperatures, strict=True):
        by_t.setdefault(t, []).append(k)
    started, out = time.monotonic(), []
    for t, ks in by_t.items():
        res = evaluate(problems, completer, t, ks, s.n_samples, limits, s.workers)
        log.info("HumanEval T=%g: %s over %d problems × %d samples (%s)", t, res.pass_at, len(problems),
                 s.n_samples, res.statuses)
        out.append(dataclasses.asdict(res))
    seconds = time.monotonic() - started
    pass_at = {k: v for r in out for k, v in r["pass_at"].items()}
    return {"problems": len(problems), "pass_at": pass_at, "by_temperature": out, "seconds": seconds,
            "problems_per_minute": len(problems) * len(by_t) * 60.0 / max(seconds, 1e-9),
            "generated_tokens": completer.generated_tokens, "isolation": isolation()[0]}


def _perplexity(run: EvalRun, model, tok, device) -> dict[str, Any]:
    from trainer.eval.perplexity import HeldOut, heldout_perplexity, jsonl_perplexity

    s, out = run.settings, {}
    if run.heldout_prefix and s.heldout_samples:
        cache = os.path.join(run.out_dir, "index-cache")
        data = HeldOut(run.heldout_prefix, run.split, run.seq_length, s.seed, cache)
        out["heldout"] = heldout_perplexity(model, data, s.heldout_samples, device, s.batch_size)
        valid = series(run.run_dir, VALID_LOSS) if run.run_dir and out["heldout"] else []
        if valid:  # the trainer's own figure on (other samples of) the validation split, for comparison
            out["heldout"]["training_valid_loss"] = {"iteration": valid[-1][0], "loss": valid[-1][1]}
    for path in s.perplexity_files:
        out[path] = jsonl_perplexity(model, tok, path, run.json_key, s.perplexity_docs, device)
    return out


def run_eval(run: EvalRun) -> dict[str, Any]:
    """Evaluate ``run.hf_dir``; returns (and writes) the results."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    s = run.settings
    if s.num_problems() and not s.allow_code_execution:  # the plan refuses this too; a direct call as well
        raise PermissionError("HumanEval executes model-written code; set eval.allow_code_execution=true")
    started = time.monotonic()
    device = torch.device(s.device)
    tok = AutoTokenizer.from_pretrained(run.hf_dir)
    model = AutoModelForCausalLM.from_pretrained(run.hf_dir).to(device).eval()
    results: dict[str, Any] = {"model": os.path.abspath(run.hf_dir), "device": str(device),
                               "settings": {**dataclasses.asdict(s), "stop_sequences": list(STOP_SEQUENCES)}}
    if s.num_problems():
        results["humaneval"] = _humaneval(run, model, tok, device)
    results["perplexity"] = _perplexity(run, model, tok, device)
    results["seconds"] = time.monotonic() - started
    out = Path(run.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"{RESULTS_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(tmp, out / RESULTS_FILE)
    _to_card(run.hf_dir, results)
    _to_wandb(run, results)
    return results


def _to_card(hf_dir: str, results: dict[str, Any]) -> None:
    from trainer.convert.card import eval_section, replace_section

    replace_section(Path(hf_dir), "Evaluation", eval_section(results))


def _to_wandb(run: EvalRun, results: dict[str, Any]) -> None:
    """Log into the training's W&B run: same id (wandb_run.json), one step after its last."""
    if not run.wandb or run.wandb.get("mode", "disabled") == "disabled" or not run.run_dir:
        return
    from trainer.config import WandbConfig
    from trainer.run.metrics import WandbLogger

    # start=None: evaluation replays no training iteration; it only logs after the run's last step.
    logger = WandbLogger(WandbConfig(**run.wandb), run.run_dir, run.run_id, {}, True, start=None)
    metrics = flat_metrics(results)
    logger.log(metrics, step=logger.last_step + 1)
    if logger.run is not None:
        logger.run.summary.update(metrics)
    logger.finish()
