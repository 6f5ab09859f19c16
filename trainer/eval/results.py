"""Reading an eval's ``results.json`` (torch-free: the summary and ``status`` read it on the login node).

The file's layout is trainer/eval/run.py's: ``humaneval`` (problems, pass_at, by_temperature with the
per-problem pass counts, isolation, seconds), ``perplexity`` (heldout and each JSONL: loss, perplexity,
tokens), ``settings``, ``model``, ``seconds``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.run_files import RunDir

RESULTS_FILE = "results.json"


def results_path(run_dir: str | Path) -> Path:
    return RunDir(run_dir).eval / RESULTS_FILE


def read_results(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's eval results; None when there are none (no eval stage, or not finished)."""
    path = results_path(run_dir)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def flat_metrics(results: dict[str, Any]) -> dict[str, float]:
    """The headline figures as ``eval/...`` metrics (the W&B names; the stage's _COMPLETE holds them too)."""
    m = {f"eval/humaneval_{k.replace('@', '_at_')}": v
         for k, v in results.get("humaneval", {}).get("pass_at", {}).items()}
    for name, p in results.get("perplexity", {}).items():
        if p:
            m[f"eval/{'heldout' if name == 'heldout' else Path(name).stem}_perplexity"] = p["perplexity"]
    return m


def pass_at_1(results: dict[str, Any] | None) -> float | None:
    return (results or {}).get("humaneval", {}).get("pass_at", {}).get("pass@1")


def describe(results: dict[str, Any]) -> list[str]:
    """Lines for the run summary: pass@k with temperatures, then each perplexity."""
    out, he = [], results.get("humaneval")
    if he:
        s = results.get("settings", {})
        ks = ", ".join(f"{k} {v:.3f} (T={r['temperature']:g})" for r in he["by_temperature"]
                       for k, v in r["pass_at"].items())
        out.append(f"{ks}; {he['problems']} problems × {s.get('n_samples')} samples, "
                   f"{he['seconds']:.0f} s, sandbox {he['isolation']}")
    for name, p in results.get("perplexity", {}).items():
        if p:
            what = f"held-out {p.get('split')} split" if name == "heldout" else name
            tv = p.get("training_valid_loss")
            ref = f"; training's validation loss {tv['loss']:.3f} at iteration {tv['iteration']}" if tv \
                else ""
            out.append(f"perplexity {p['perplexity']:.2f} (loss {p['loss']:.3f}) on {what} "
                       f"({p['tokens']:,} tokens{ref})")
    return out
