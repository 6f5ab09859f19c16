"""The closing summary of a completed run: where everything is, the final losses, a loss-curve PNG, the
converted model's sample and how to upload the offline W&B run. Read from the run directory only."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.base.estimate import fmt_duration
from orchestrator.readback.goodput import run_lines
from orchestrator.record.launches import current
from orchestrator.stages.convert import NAME as CONVERT
from orchestrator.stages.tuning import verdict as verdict_of
from orchestrator.world.progress import checkpoint_iter, wandb_offline_dirs
from orchestrator.world.runs import read_json
from trainer.checkpoint.verify import read_warnings
from trainer.eval.results import describe, read_results, results_path
from trainer.metrics_file import TRAIN_LOSS, VALID_LOSS, kernel_fallbacks, last_kernel_check, series
from trainer.run_files import COMPLETE, RUN_JSON, RunDir
from trainer.wandb_online import sync_command


@dataclass
class RunOutcome:
    """What a finished run left behind (None/empty where a stage did not produce it)."""

    run_dir: str
    train: list[tuple[int, float]] = field(default_factory=list)  # (iteration, train lm loss)
    valid: list[tuple[int, float]] = field(default_factory=list)  # (iteration, validation lm loss)
    hf_dir: str | None = None
    verification: str | None = None
    hf_iteration: int | None = None  # the checkpoint iteration the HF model was converted from
    checkpoint_iteration: int | None = None  # the run's latest checkpoint (the tracker)
    sample: str | None = None
    sample_how: str = "greedy"  # how the sample was decoded
    wandb_dir: str | None = None
    wandb_dirs: list[str] = field(default_factory=list)  # every offline folder of the run (train, eval)
    checkpoint_warnings: list[str] = field(default_factory=list)  # checkpoints skipped at load (damaged)
    evaluation: dict | None = None  # <run_dir>/eval/results.json (trainer/eval/results.py)
    kernel_check: dict | None = None  # the start-up kernel self-check (train_metrics.jsonl)
    layout: str | None = None  # layout=auto tune=true: the decision training took (stages/tuning.py)
    layout_wandb_dirs: list[str] = field(default_factory=list)  # its table's offline W&B run(s)
    goodput: list[str] = field(default_factory=list)  # readback/goodput.py: over every training attempt


def _losses(run_dir: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """Train and validation losses from the trainer's metrics file (replayed iterations: the last wins)."""
    return series(run_dir, TRAIN_LOSS), series(run_dir, VALID_LOSS)


def _convert_result(run_dir: Path, meta: dict) -> tuple[str | None, str | None, int | None]:
    """(HF dir, verification verdict, checkpoint iteration converted) from the convert stage's marker."""
    state = meta.get("stages", {}).get(CONVERT, {}).get("dir")
    if not state or not (Path(state) / COMPLETE).exists():
        return None, None, None
    result = read_json(Path(state) / COMPLETE).get("result") or {}
    verdict = str(result.get("result", ""))
    it = result.get("iteration")
    return result.get("hf"), verdict.split(": ", 1)[-1] or None, it if isinstance(it, int) else None


def _sample(run_dir: Path) -> tuple[str | None, str]:
    """(text, how it was decoded) from ``sample.txt``, whose first line is a ``# sample (how) ...`` header."""
    path = RunDir(run_dir).sample
    if not path.exists():
        return None, ""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    header = lines.pop(0) if lines and lines[0].startswith("#") else ""
    how = re.match(r"# sample \(([^)]*)\)", header)
    return "\n".join(lines).rstrip() or None, how.group(1) if how else "greedy"


def outcome(run_dir: str) -> RunOutcome:
    run = Path(run_dir)
    train, valid = _losses(run)
    launch = current(read_json(run / RUN_JSON))
    hf, verdict, hf_iter = _convert_result(run, launch)
    sample, how = _sample(run)
    dirs = wandb_offline_dirs(run)
    table = read_json(RunDir(run).layout_table) if RunDir(run).layout_table.exists() else None
    return RunOutcome(run_dir, train, valid, hf, verdict, hf_iter, checkpoint_iter(run, launch), sample, how,
                      dirs[-1] if dirs else None, dirs, read_warnings(run_dir), read_results(run_dir),
                      last_kernel_check(run_dir), verdict_of(table) if table else None,
                      sorted(str(p) for p in RunDir(run).tune.glob("wandb/offline-run-*") if p.is_dir()),
                      run_lines(run))


def plot_losses(o: RunOutcome, out: Path) -> Path | None:
    """Train loss as a line, validation loss as points; None when nothing was logged."""
    if not o.train and not o.valid:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if o.train:
        ax.plot(*zip(*o.train, strict=True), label="train")
    if o.valid:
        ax.plot(*zip(*o.valid, strict=True), "o-", label="validation")
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title(f"Slipway run {Path(o.run_dir).name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _last(points: list[tuple[int, float]]) -> str:
    return f"{points[-1][1]:.3f} (iteration {points[-1][0]})" if points else "n/a"


def _kernel_lines(check: dict | None) -> list[str]:
    """The kernel self-check: what was checked where, or a warning per op it switched to eager."""
    if not check:
        return []
    bad = kernel_fallbacks(check)
    if bad:
        return [f"  kernels          WARNING: {w}" for w in bad]
    checked = check.get("checked", {})
    where = f"{check.get('device')} {'+'.join(check.get('dtypes', []))}"
    return [f"  kernels          {len(checked)} fused ops ({', '.join(sorted(set(checked.values())))}) agree "
            f"with eager on {where} (self-check, {check.get('seconds', 0):.2f} s)"]


def _hf_line(o: RunOutcome) -> str:
    """The HF model and the iteration it holds; a loud warning when that is not the run's latest
    checkpoint (it would be a stale model presented as the run's result)."""
    if not o.hf_dir:
        return "n/a (no conversion)"
    if o.hf_iteration is None:
        return o.hf_dir
    stale = (f" — WARNING: the run's latest checkpoint is iteration {o.checkpoint_iteration}; convert it "
             "again (relaunch the run)") if o.checkpoint_iteration not in (None, o.hf_iteration) else ""
    return f"{o.hf_dir} (iteration {o.hf_iteration}){stale}"


def format_summary(o: RunOutcome, png: Path | None, elapsed_s: float | None = None) -> str:
    took = f" in {fmt_duration(elapsed_s)}" if elapsed_s is not None else ""
    first = f", from {o.train[0][1]:.3f} at iteration {o.train[0][0]}" if len(o.train) > 1 else ""
    lines = [
        f"Slipway run finished{took}",
        f"  run directory    {o.run_dir}",
        f"  train loss       {_last(o.train)}{first}",
        f"  validation loss  {_last(o.valid)}",
        f"  loss curve       {png or 'n/a (no losses logged)'}",
        f"  HF model         {_hf_line(o)}",
    ]
    if o.verification:
        lines.append(f"                   {o.verification}")
    if o.layout:
        table = RunDir(o.run_dir).layout_table_text
        lines += [f"  layout (auto)    {o.layout}", f"                   ({table})"]
    lines += [f"  checkpoint       WARNING: {w}" for w in o.checkpoint_warnings]
    lines += [f"  {'goodput' if i == 0 else '':<16} {g}" for i, g in enumerate(o.goodput)]
    lines += _kernel_lines(o.kernel_check)
    if o.evaluation:
        found = describe(o.evaluation) or ["n/a (nothing evaluated)"]
        lines.append(f"  evaluation       {found[0]}")
        lines += [f"                   {x}" for x in found[1:]]
        lines.append(f"                   ({results_path(o.run_dir)})")
    if o.sample:
        sample = o.sample.splitlines() or [""]
        lines.append(f"  sample           {sample[0]}")
        lines += [f"                   {s}" for s in sample[1:]]
        lines.append(f"                   ({o.sample_how}; the model's text continues the prompt)")
    if o.wandb_dir or o.layout_wandb_dirs:
        dirs = [*(o.wandb_dirs or ([o.wandb_dir] if o.wandb_dir else [])), *o.layout_wandb_dirs]
        lines += [f"  W&B (offline)    {o.wandb_dir or o.layout_wandb_dirs[-1]}",
                  f"  upload to W&B    {sync_command(dirs)}"]
    if o.hf_dir:
        # max_new_tokens: the pipeline's default (256) runs past a small model's positions.
        lines.append(
            "  try it           python -c \"from transformers import pipeline; "
            f"g = pipeline('text-generation', '{o.hf_dir}'); "
            "print(g('def fibonacci(', max_new_tokens=32)[0]['generated_text'])\""
        )
    return "\n".join(lines) + "\n"


def write_summary(run_dir: str, elapsed_s: float | None = None) -> str:
    """Write ``loss.png`` and ``summary.txt`` into the run directory; return the summary text."""
    o = outcome(run_dir)
    png = plot_losses(o, RunDir(run_dir).loss_plot)
    text = format_summary(o, png, elapsed_s)
    RunDir(run_dir).summary.write_text(text, encoding="utf-8")
    return text
