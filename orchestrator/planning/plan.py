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
import itertools
import os
from typing import Any

from orchestrator.base.estimate import (
    NO_MEMORY,
    NO_TIME,
    MemoryOption,
    estimate_memory,
    estimate_time,
)
from orchestrator.base.facts import PlanInputs, SweepInfo
from orchestrator.base.layout import Layout, layout_of
from orchestrator.base.plan_types import Context, Estimates, Plan
from orchestrator.base.problems import arrange
from orchestrator.base.schema import SlipwayConfig
from orchestrator.checks import run_checks
from orchestrator.checks.run import insane_values
from orchestrator.planning import autolayout
from orchestrator.stages import STAGES
from orchestrator.stages.base import PlanContext
from trainer.config_issues import deferred
from trainer.formulas import model_vocab_size
from trainer.wandb_key import key_source

__all__ = ["PlanInputs", "SweepInfo", "make_plan", "memory_options", "resolve_vocab"]

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


def _replica_config(cfg: SlipwayConfig, tp: int, pp: int) -> SlipwayConfig:
    """``cfg`` as one model replica on tp × pp devices (dp 1) with every memory saver that applies."""
    with deferred():
        parallel = dataclasses.replace(cfg.parallel, tp_size=tp, pp_size=pp, virtual_pp_size=1,
                                       sequence_parallel=tp > 1)
        train = dataclasses.replace(cfg.train, recompute_granularity="full", recompute_method="uniform",
                                    recompute_num_layers=1, global_batch_size=None)
        cluster = dataclasses.replace(cfg.cluster, nodes=1, gpus=None, tasks_per_node=tp * pp)
        return dataclasses.replace(cfg, parallel=parallel, train=train, cluster=cluster)


def smallest_replica(cfg: SlipwayConfig, vocab: int) -> tuple[int, int] | None:
    """The fewest devices (tp, pp) one model replica fits on with every memory saver, tp within a node
    (parallel layouts Megatron allows: tp divides the heads and the KV groups, pp the layers); None when
    no split fits."""
    m, per_node = cfg.model, cfg.cluster.gpus_per_node
    tps = [d for d in range(1, m.num_attention_heads + 1)
           if m.num_attention_heads % d == 0 and m.query_groups % d == 0 and (not per_node or d <= per_node)]
    pps = [d for d in range(1, m.num_layers + 1) if m.num_layers % d == 0]
    for tp, pp in sorted(itertools.product(tps, pps), key=lambda s: (s[0] * s[1], s[1])):
        alt = _replica_config(cfg, tp, pp)
        if estimate_memory(alt, vocab, layout_of(alt)).fits:
            return tp, pp
    return None


def plan_warnings(cfg: SlipwayConfig, lay: Layout) -> list[str]:
    """What the plan says before submitting without refusing it."""
    c, out = cfg.cluster, insane_values(Context(cfg))
    if cfg.eval.enabled and not cfg.convert.enabled:
        out.append("no eval stage: convert.enabled=false leaves no converted model to evaluate (eval=none "
                   "says so without this warning)")
    # A TP group is tp consecutive ranks (trainer/parallel/state.py): within a node when tp divides the
    # tasks per node.
    if lay.nodes > 1 and lay.tp > 1 and lay.tasks_per_node % lay.tp:
        out.append(f"parallel.tp_size={lay.tp} spans nodes ({lay.tasks_per_node} tasks per node): every "
                   "layer's tensor-parallel all-reduces then cross the network instead of staying within a "
                   f"node; use a tp_size that divides {lay.tasks_per_node} and grow pp_size or dp instead")
    if c.executor == "slurm" and c.gpus_per_node and not c.stage_partition:
        out.append(f"the CPU-only stages (corpus, preprocess, convert; eval on cpu) go to the training "
                   f"partition {c.partition or '(the site default)'} and hold a GPU node's slot: set "
                   "cluster.stage_partition in the site file to a CPU partition")
    return out


def make_plan(cfg: SlipwayConfig, facts: PlanInputs, exists: Any = os.path.exists) -> Plan:
    """Everything about a launch that can be known before submitting (no job is touched). With
    layout=auto the plan is the first choice's (planning/autolayout.py); ``Plan.config`` holds it."""
    vocab = resolve_vocab(cfg, facts)
    proposal = autolayout.propose(cfg, vocab) if cfg.layout == "auto" else None
    if proposal is not None and proposal.ranked:
        cfg = autolayout.apply(cfg, proposal.ranked[0].candidate, proposal.global_batch,
                               proposal.tasks_per_node)
    lay = layout_of(cfg)
    # A model or layout whose own rules fail (a size of 0) has no estimate: its formulas divide by them.
    sized = not cfg.model.problems() and not cfg.parallel.problems()
    mem = estimate_memory(cfg, vocab, lay) if sized else NO_MEMORY
    est = estimate_time(cfg, vocab, lay) if sized else NO_TIME
    estimates = None
    choices: list[MemoryOption] = []
    if sized and lay.dp and lay.num_microbatches:
        choices = memory_options(cfg, vocab, lay)
        nowhere = not mem.fits and not any(o.memory.fits for o in choices)
        estimates = Estimates(mem, est, choices, smallest_replica(cfg, vocab) if nowhere else None)
    checked = Context(cfg, facts.environ, exists, estimates, proposal=proposal)
    problems = arrange(run_checks(checked, at="plan"))  # root causes first (orchestrator/base/problems.py)
    ctx = PlanContext(cfg, facts, proposal=proposal)
    for stage in STAGES:
        planned = stage.plan(ctx)
        if planned is not None:
            ctx.planned[stage.name] = planned
    return Plan(
        facts.run_id, facts.run_dir, cfg.experiment, lay, vocab, mem, est, list(ctx.planned.values()),
        problems, facts.sweep,
        warnings=plan_warnings(cfg, lay),
        memory_options=choices,
        config=cfg,
        proposal=proposal,
        wandb_key=key_source(facts.environ),
    )
