"""config → Plan: validation, estimates and the stage graph, as pure functions.

The stages come from orchestrator/stages/ (one module each, in dependency order); each plans itself from
the config, the facts and the stages planned before it. Shared stages (corpus, preprocess) write into
``<cache_dir>/<stage>/<key>/`` where the key hashes the config slice that produces the output plus the
version of the code that produces it, so a second launch over the same data finds the output complete and
skips the stage, and two sweep points needing the same key share one job. Per-run stages (train, convert,
eval) write into the run directory.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from orchestrator.checks import Context, Estimates, run_checks
from orchestrator.estimate import (
    MemoryEstimate,
    MemoryOption,
    TimeEstimate,
    estimate_memory,
    estimate_time,
)
from orchestrator.facts import PlanInputs, SweepInfo
from orchestrator.layout import Layout, layout_of
from orchestrator.problems import Problem
from orchestrator.schema import SlipwayConfig
from orchestrator.stages import STAGES
from orchestrator.stages.base import PlanContext, StagePlan
from trainer.checks import deferred
from trainer.formulas import model_vocab_size

__all__ = ["Plan", "PlanInputs", "StagePlan", "SweepInfo", "make_plan", "memory_options", "resolve_vocab"]

@dataclass
class Plan:
    run_id: str
    run_dir: str
    experiment: str
    layout: Layout
    vocab_size: int
    memory: MemoryEstimate
    time: TimeEstimate
    stages: list[StagePlan]
    problems: list[Problem]
    sweep: SweepInfo | None = None
    warnings: list[str] = field(default_factory=list)  # said before submitting; nothing is refused
    memory_options: list[MemoryOption] = field(default_factory=list)  # memory_options()

    def stage(self, name: str) -> StagePlan:
        return next(s for s in self.stages if s.name == name)


def resolve_vocab(cfg: SlipwayConfig, facts: PlanInputs) -> int:
    """The vocabulary the trainer will build (trainer.formulas.model_vocab_size); 0 when unknown here."""
    return model_vocab_size(cfg.model.vocab_size, facts.vocab_from_file or cfg.tokenizer.vocab_size) or 0


# The options that trade memory for time or communication without changing the math, as
# (key, section, field, values): the dry run's table shows the run at each value it is not using, and the
# advice for a memory problem names those that would lower the total. One list for both.
MEMORY_OPTIONS = (
    ("train.recompute_granularity", "train", "recompute_granularity", ("none", "selective", "full")),
    ("optim.distributed", "optim", "distributed", (False, True)),
    ("parallel.sequence_parallel", "parallel", "sequence_parallel", (False, True)),
    ("parallel.virtual_pp_size", "parallel", "virtual_pp_size", (1, 2)),
)


def _applies(key: str, lay: Layout) -> bool:
    """Options that do nothing at this layout are not offered (no DP shards, no TP group, one stage)."""
    return {"optim.distributed": lay.dp > 1, "parallel.sequence_parallel": lay.tp > 1,
            "parallel.virtual_pp_size": lay.pp > 1}.get(key, True)


def _value_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def with_option(cfg: SlipwayConfig, section: str, fields: dict) -> SlipwayConfig:
    """``cfg`` with one section's fields changed; the plan reports the config's problems itself, so a
    config that already has some is still estimated (checks deferred, as when it was composed)."""
    with deferred():
        return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **fields)})


def memory_options(cfg: SlipwayConfig, vocab: int, lay: Layout) -> list[MemoryOption]:
    """The run at every other value of each of MEMORY_OPTIONS (one change at a time), then with all the
    memory-saving values together, each with the plan's own per-device estimate and step time."""
    step = estimate_time(cfg, vocab, lay).step_s

    def option(name: str, alt: SlipwayConfig) -> MemoryOption:
        ratio = estimate_time(alt, vocab, lay).step_s / step
        return MemoryOption(name, estimate_memory(alt, vocab, lay), ratio)

    out, lowest, saving = [], cfg, 0
    for key, section, name, values in MEMORY_OPTIONS:
        if not _applies(key, lay):
            continue
        current = getattr(getattr(cfg, section), name)
        for value in values:
            if value != current:
                out.append(option(f"{key}={_value_text(value)}", with_option(cfg, section, {name: value})))
    for key, section, name, values in MEMORY_OPTIONS[:3]:  # the three that only save memory
        best = values[-1]
        if _applies(key, lay) and getattr(getattr(cfg, section), name) != best:
            lowest, saving = with_option(lowest, section, {name: best}), saving + 1
    if saving > 1:
        out.append(option("all memory savers", lowest))
    return out


def make_plan(cfg: SlipwayConfig, facts: PlanInputs, exists: Any = os.path.exists) -> Plan:
    """Everything about a launch that can be known before submitting (no job is touched)."""
    lay = layout_of(cfg)
    vocab = resolve_vocab(cfg, facts)
    mem = estimate_memory(cfg, vocab, lay)
    est = estimate_time(cfg, vocab, lay)
    choices = memory_options(cfg, vocab, lay) if lay.dp and lay.num_microbatches else []
    estimates = Estimates(mem, est, choices) if lay.dp and lay.num_microbatches else None
    problems = run_checks(Context(cfg, facts.environ, exists, estimates), at="plan")
    ctx = PlanContext(cfg, facts)
    for stage in STAGES:
        planned = stage.plan(ctx)
        if planned is not None:
            ctx.planned[stage.name] = planned
    warnings = ["no eval stage: convert.enabled=false leaves no converted model to evaluate (eval=none says "
                "so without this warning)"] if cfg.eval.enabled and not cfg.convert.enabled else []
    return Plan(
        facts.run_id, facts.run_dir, cfg.experiment, lay, vocab, mem, est, list(ctx.planned.values()),
        problems, facts.sweep,
        warnings=warnings,
        memory_options=choices,
    )
