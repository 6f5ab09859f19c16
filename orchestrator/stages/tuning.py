"""layout=auto tune=true, the decision: every trial's measurement beside the plan's estimate, ranked by
measured tokens/s; training takes the fastest.

The train job decides when it starts (orchestrator/stages/train.py): every rank reads the trials' records
(orchestrator/stages/trials.py) and computes the same table; rank 0 writes it to ``<run_dir>/tune/`` (RunDir's
``layout_table`` and ``layout_table_text``) and, with W&B on, logs it as a run of its own in the run's
group. The table is the decision: a requeue or a relaunch finds it for the same tuning (its key and trial
job) and trains with the same layout instead of tuning again (tune=force tunes again). A trial that failed
(out of memory, a hang, killed) is a row with its reason; the others decide. The table shows, for every
candidate, the plan's estimate and the measurement, and the Spearman rank correlation of the plan's ranking
with the measured one: how far the plan's step-time model can be trusted to choose alone.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orchestrator.base.estimate import fmt_bytes
from orchestrator.stages.trials import FAILED, MEASURED, read_json
from orchestrator.world.runs import write_json, write_text
from trainer.health import read_hangs
from trainer.log import get_logger
from trainer.run_files import TRIAL_RECORD, TRIAL_SPEC, RunDir

log = get_logger(__name__)

MISSING = "missing"


@dataclass(frozen=True)
class Tuning:
    """Which tuning a decision is for: the run, its candidates (index, name, overrides, the plan's
    estimate), the tuning's key and the trial job (None: the tune stage was reused, any job's)."""

    run_dir: str
    candidates: list[dict[str, Any]]
    key: str
    job: str | None = None


class NoLayoutMeasured(ValueError):
    """No trial measured anything: training cannot choose (a ValueError: not retried, trainer.signals)."""


def _record_ok(record: dict[str, Any], key: str, job: str | None, index: int) -> bool:
    """A record of this tuning: its key, and (when the tuning job is known) written by that job (a Slurm
    array element is ``<array id>_<index>``, a local job its controller's pid)."""
    return record.get("key") == key and (job is None or str(record.get("job")) in (job, f"{job}_{index}"))


def _silent(run: RunDir, index: int, slurm_state: Callable[[str], str | None] | None, job: str | None) -> str:
    """Why a trial without any record ended: its watchdog's hang report, else what Slurm says."""
    spec = read_json(run.trial_spec(index)) or {}
    if job is not None and str(spec.get("job")) not in (job, f"{job}_{index}"):
        spec = {}  # another tuning's trial: this one never started it
    started = float(spec.get("started", 0))
    hangs = [h for h in read_hangs(str(run.trial(index))) if float(h.get("time", 0)) >= started]
    if spec and hangs:
        h = hangs[0]
        return (f"hang: no training progress for {h.get('idle_s')} s at iteration {h.get('iteration')} (the "
                "watchdog ended it, autotune.hang_timeout_s)")
    if not spec:
        return "never started (cancelled, or its job never ran)"
    state = slurm_state(f"{job}_{index}") if slurm_state is not None and job else None
    return (f"ended without a result{f' (Slurm: {state})' if state else ''}: killed by the time limit "
            f"(autotune.time_limit_min) or for memory? see {run.trial(index)}")


def outcome(run_dir: str, cand: dict[str, Any], key: str, job: str | None,
            slurm_state: Callable[[str], str | None] | None = None) -> dict[str, Any]:
    """One candidate's row: the plan's estimate and what its trial recorded (measured, or failed and why)."""
    run, i = RunDir(run_dir), int(cand["index"])
    records = [r for p in sorted(run.trial(i).glob(TRIAL_RECORD.format(rank="*")))
               if (r := read_json(p)) is not None and _record_ok(r, key, job, i)]
    row = {k: cand[k] for k in ("index", "name", "overrides", "estimate")}
    good = next((r for r in records if r.get("status") == MEASURED), None)
    if good is not None:
        return {**row, "status": MEASURED, "measured": good["measured"], "reason": ""}
    failed = sorted((r for r in records if r.get("status") == FAILED), key=lambda r: r.get("time", 0))
    if failed:
        reason = str(failed[0].get("reason", "failed"))
        where = f" (rank {failed[0].get('rank')})" if failed[0].get("rank") else ""
        return {**row, "status": FAILED, "measured": None, "reason": reason + where}
    return {**row, "status": MISSING, "measured": None, "reason": _silent(run, i, slurm_state, job)}


def outcomes_so_far(run_dir: str, job: str) -> list[dict[str, Any]]:
    """The outcome of every trial tune job ``job`` started (from the specs its trials wrote), in the plan's
    order: what status shows before the decision exists."""
    out = []
    for path in sorted(RunDir(run_dir).tune.glob(f"trial_*/{TRIAL_SPEC}")):
        spec = read_json(path) or {}
        if str(spec.get("job")) in (job, f"{job}_{spec.get('index')}"):
            cand = {"index": spec["index"], "name": spec.get("name", ""),
                    "overrides": spec.get("overrides", {}), "estimate": {}}
            out.append(outcome(run_dir, cand, str(spec.get("key")), job))
    return sorted(out, key=lambda r: r["index"])


def _ranks(values: list[float]) -> list[float]:
    """Ranks 1..n of ``values`` (ascending), ties given their average rank (Spearman's convention)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman's rank correlation (Pearson's on the ranks, ties averaged); None with fewer than two
    pairs or when either side is constant."""
    if len(x) != len(y) or len(x) < 2:
        return None
    rx, ry = _ranks(x), _ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx and syy else None


def decide(t: Tuning, slurm_state: Callable[[str], str | None] | None = None) -> dict[str, Any]:
    """The table: every candidate's row, measured ones first by tokens/s (ties: the plan's order), the
    winner (None when no trial measured anything), its speed-up over the plan's first choice and the
    plan's rank correlation with the measurement."""
    key, job = t.key, t.job
    rows = [outcome(t.run_dir, c, key, job, slurm_state) for c in t.candidates]
    measured = sorted((r for r in rows if r["status"] == MEASURED),
                      key=lambda r: (-r["measured"]["tokens_per_s"], r["index"]))
    for rank, r in enumerate(measured, 1):
        r["measured_rank"] = rank
    table: dict[str, Any] = {
        "key": key, "tune_job": job, "decided": time.time(), "trials": len(rows),
        "rows": measured + sorted((r for r in rows if r["status"] != MEASURED), key=lambda r: r["index"]),
        "winner": None, "speedup": None, "spearman": None, "spearman_n": len(measured),
        "spearman_step": None}
    if not measured:
        return table
    first = min(rows, key=lambda r: r["index"])
    table["winner"] = measured[0]["index"]
    if first["status"] == MEASURED:
        table["speedup"] = measured[0]["measured"]["tokens_per_s"] / first["measured"]["tokens_per_s"]
    # The plan's ranking (its order, 0 first: the estimate with its tie-breaking) against the measured one
    # (fastest first); and the estimated step times themselves against the measured ones (equal estimates
    # share a rank): how far the step-time model orders what it is asked to order, ties left as ties.
    table["spearman"] = spearman([r["index"] for r in measured], [r["measured_rank"] for r in measured])
    steps = [(r["estimate"].get("step_s"), r["measured"].get("step_s")) for r in measured]
    steps = [(e, m) for e, m in steps if e is not None and m is not None and math.isfinite(e)]
    table["spearman_step"] = spearman([e for e, _ in steps], [m for _, m in steps])
    return table


def spelled(overrides: dict[str, dict[str, Any]]) -> str:
    """A layout's overrides as command-line words (to pin it with layout=manual)."""
    def word(value: Any) -> str:
        return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)

    return " ".join(f"{section}.{key}={word(value)}" for section, values in overrides.items()
                    for key, value in values.items())


def winner(table: dict[str, Any]) -> dict[str, Any] | None:
    return next((r for r in table["rows"] if r["index"] == table.get("winner")), None)


def verdict(table: dict[str, Any]) -> str:
    """One line: which layout training takes and by how much it beat the plan's first choice."""
    win = winner(table)
    if win is None:
        return f"no trial of {table['trials']} measured anything: nothing to choose from"
    first = min(table["rows"], key=lambda r: r["index"])
    speed = f"{win['measured']['tokens_per_s']:,.1f} tokens/s"
    if win["index"] == first["index"]:
        how = "the plan's first choice was the fastest"
    elif table.get("speedup"):
        how = f"{table['speedup']:.2f}× the tokens/s of the plan's first choice ({first['name']})"
    else:
        how = f"the plan's first choice ({first['name']}) {first['status']}: {first['reason']}"
    return f"{win['name']} (the plan's #{win['index'] + 1}), {speed}: {how}"


def _num(x: float | None, fmt: str) -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def format_table(table: dict[str, Any]) -> str:
    """The table for people: estimate beside measurement for every candidate."""
    head = (f"{'rank':>4} {'plan':>4}  {'layout':<26}{'est. step':>11}{'est. tok/s':>12}{'est. mem':>11}"
            f"{'step':>10}{'±':>6}{'tok/s':>12}{'peak mem':>11}{'MFU':>7}  outcome")
    lines = [f"layout=auto: {table['trials']} trial(s) (tuning {table['key']}, job {table.get('tune_job')})",
             head]
    for r in table["rows"]:
        e, m = r["estimate"], r.get("measured") or {}
        est = (f"{_num(e.get('step_s'), '.4f'):>11}{_num(e.get('tokens_per_s'), ',.0f'):>12}"
               f"{fmt_bytes(e.get('memory_bytes', 0)).strip():>11}")
        peak = "—" if m.get("peak_mem_gb") is None else fmt_bytes(m["peak_mem_gb"] * 1e9).strip()
        mfu = "—" if m.get("mfu") is None else f"{m['mfu']:.1%}"
        # ±: half the range of the measured intervals' step times, of their mean (how noisy the figure is)
        spread = ((m["step_max_s"] - m["step_min_s"]) / 2 / m["step_s"]) if m.get("step_max_s") else None
        pm = "—" if spread is None else f"{spread:.0%}"
        got = (f"{_num(m.get('step_s'), '.4f'):>10}{pm:>6}"
               f"{_num(m.get('tokens_per_s'), ',.0f'):>12}{peak:>11}{mfu:>7}")
        rank = str(r.get("measured_rank", "-"))
        what = "measured" if r["status"] == MEASURED else f"{r['status']}: {r['reason']}"
        lines.append(f"{rank:>4} {r['index'] + 1:>4}  {r['name']:<26}{est}{got}  {what}")
    lines.append(f"  decision: {verdict(table)}")
    lines += spearman_lines(table)
    win = winner(table)
    if win is not None:
        lines.append(f"  to pin this layout: layout=manual {spelled(win['overrides'])}")
    return "\n".join(lines) + "\n"


def spearman_lines(table: dict[str, Any]) -> list[str]:
    """The table's rank correlations, for people: the plan's ranking, and its step-time estimate (ties left
    as ties; n/a where every estimate or every measurement is equal), against the measurement."""
    def rho(key: str) -> str:
        value = table.get(key)
        return "n/a" if value is None else f"{value:+.2f}"

    n = table["spearman_n"]
    return [f"  Spearman rank correlation, plan's ranking vs measured: {rho('spearman')} over {n} measured "
            "trial(s)",
            f"  Spearman rank correlation, estimated vs measured step time: {rho('spearman_step')} over {n}"]


def write_table(run_dir: str, table: dict[str, Any]) -> None:
    run = RunDir(run_dir)
    run.tune.mkdir(parents=True, exist_ok=True)
    write_json(run.layout_table, table)
    write_text(run.layout_table_text, format_table(table))


def stored(run_dir: str, key: str, job: str | None) -> dict[str, Any] | None:
    """The decision already taken for this tuning (its key; and this trial job, when one ran in this
    launch), else None."""
    table = read_json(RunDir(run_dir).layout_table)
    if table is None or table.get("key") != key or table.get("winner") is None:
        return None
    return table if job is None or str(table.get("tune_job")) == str(job) else None


def log_wandb(table: dict[str, Any], wandb_cfg: dict[str, Any], run_dir: str, run_id: str) -> str | None:
    """Log the table as a W&B run of its own in the run's group (``<name>/layout``, job type
    layout-tune), beside the training run; never fails the job (a warning instead). Its run id, or None."""
    mode = wandb_cfg.get("mode", "disabled")
    if mode == "disabled":
        return None
    try:
        import wandb

        from trainer.wandb_online import base_url, probe

        if mode == "online" and probe(base_url()).reason is not None:
            mode = "offline"
        RunDir(run_dir).tune.mkdir(parents=True, exist_ok=True)
        run = wandb.init(mode=mode, project=wandb_cfg.get("project"), entity=wandb_cfg.get("entity"),
                         group=wandb_cfg.get("group") or run_id,
                         name=f"{wandb_cfg.get('name') or run_id}/layout",
                         job_type="layout-tune", dir=str(RunDir(run_dir).tune),
                         config={"layout": "auto", "tuning": table["key"], "trials": table["trials"]},
                         settings=wandb.Settings(silent=True, console="off"))
        columns = ["measured_rank", "plan_rank", "layout", "est_step_s", "est_tokens_per_s", "est_memory_gib",
                   "step_s", "tokens_per_s", "peak_mem_gb", "mfu", "outcome"]
        data = [[r.get("measured_rank"), r["index"] + 1, r["name"], r["estimate"].get("step_s"),
                 r["estimate"].get("tokens_per_s"), r["estimate"].get("memory_bytes", 0) / 2**30,
                 *((r.get("measured") or {}).get(k)
                   for k in ("step_s", "tokens_per_s", "peak_mem_gb", "mfu")),
                 "measured" if r["status"] == MEASURED else f"{r['status']}: {r['reason']}"]
                for r in table["rows"]]
        run.log({"layout/trials": wandb.Table(columns=columns, data=data)})
        run.summary.update({"layout/winner": (winner(table) or {}).get("name"),
                            "layout/speedup": table["speedup"], "layout/spearman": table["spearman"],
                            "layout/spearman_step": table.get("spearman_step")})
        wid = run.id
        run.finish()
        return wid
    except Exception as err:  # noqa: BLE001 - a monitoring tool must not cost the training run
        log.warning("W&B: the layout table was not logged (%s: %s); it is in %s", type(err).__name__, err,
                    RunDir(run_dir).layout_table)
        return None


def decided(t: Tuning, rank: int, slurm_state: Callable[[str], str | None] | None = None,
            wandb_cfg: dict[str, Any] | None = None, run_id: str = "") -> dict[str, Any]:
    """The decision for this tuning: the stored one, else taken now from the trials' records (rank 0
    writes it and logs it to W&B). Every rank gets the same table. Raises :class:`NoLayoutMeasured`."""
    run_dir = t.run_dir
    table = stored(run_dir, t.key, t.job)
    if table is not None:
        return table
    table = decide(t, slurm_state)
    if rank == 0:
        write_table(run_dir, table)
    if table["winner"] is None:
        reasons = "; ".join(f"{r['name']}: {r['reason']}" for r in table["rows"])
        raise NoLayoutMeasured(f"layout=auto: none of the {table['trials']} trials measured anything "
                               f"({reasons}); "
                               f"see {RunDir(run_dir).layout_table_text}. Fix what they name, then launch "
                               "again with tune=force, or choose the layout yourself (layout=manual)")
    if rank == 0 and wandb_cfg:
        table["wandb"] = log_wandb(table, wandb_cfg, run_dir, run_id)
        write_table(run_dir, table)
    return table


def apply_winner(trainer_config: dict[str, Any], table: dict[str, Any]) -> dict[str, Any]:
    """The train job's trainer config with the winning layout's fields."""
    out = json.loads(json.dumps(trainer_config))
    for section, values in (winner(table) or {}).get("overrides", {}).items():
        out[section].update(values)
    return out
