"""layout=auto, the proposal (pure): every parallel layout of the run's world and global batch that the
plan accepts and that fits the site's devices, ranked by the plan's own step-time estimate.

The search keeps what changes the math fixed — the model, the global batch, the world (cluster.nodes ×
the tasks per node) — and varies what does not (NeMo's AutoConfigurator varies the same knobs):

- ``tp`` over the divisors of the tasks per node (a tensor-parallel group stays within a node);
- ``pp`` over the divisors of world / tp (dp is the rest); where pp does not divide the layers, Megatron's
  uneven split (first and/or last stage holding other counts, parallel.first_stage_layers /
  last_stage_layers) with the fewest layers on the busiest stage, every such split a candidate;
- ``virtual_pp_size``, ``micro_batch_size``, ``recompute_granularity`` and ``optim.distributed`` over the
  lists in the ``autotune`` section, the run's own ``train.micro_batch_size`` among the micro-batches
  (sequence parallelism is on wherever tp > 1 allows it: same math, less memory, Megatron's advice).

Each combination is checked by the plan's own rules — the model's tensor split (``ModelConfig.tp_issues``),
the pipeline split (:func:`orchestrator.checks.layout.pipeline_split`), the layout and batch checks
(:func:`orchestrator.checks.layout.layout_problems`), each section's rules — and then by the plan's memory
estimate against the device less its headroom (``cluster.memory_headroom``, MemoryEstimate.limit_bytes);
the first rule it breaks is why it was dropped. What is left is ranked by the plan's estimated step time
(orchestrator/base/estimate.py: FLOPs at the measured MFU scaled to the candidate's micro-batch by the
measured efficiency curve — a micro-batch's matrix products on one GPU, tokens × hidden² / tp, run at
x/(x + half) of the saturated speed, so a larger micro-batch or a smaller tp computes faster —, the
tensor-parallel all-reduces at the node's bandwidth, the pipeline bubble, the data-parallel exchange).
Ties (equal to 9 significant digits: layouts that differ only in memory, or micro-batches on CPUs, where
no curve is measured) go to the layout that needs less memory, then the smaller tp × pp, less
recomputation, no distributed optimizer, no interleaving. Which of them is really fastest is what the
trials measure (orchestrator/stages/tune.py).
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from dataclasses import dataclass, field
from typing import Any

from orchestrator.base.estimate import (
    GIB,
    MemoryEstimate,
    TimeEstimate,
    estimate_memory,
    estimate_time,
    fmt_bytes,
)
from orchestrator.base.layout import layout_of, tasks_per_node
from orchestrator.base.plan_types import Context
from orchestrator.base.schema import RECOMPUTE_CHOICES, SlipwayConfig
from orchestrator.checks.layout import layout_problems, pipeline_split
from trainer.config_issues import deferred
from trainer.formulas import PipelineSplit

# Why a candidate was dropped, by the code of the rule it broke (the plan's problem codes), for people.
_REASONS = {
    "tp_num_attention_heads": "tp does not divide the attention heads",
    "tp_heads": "tp does not divide the attention heads",
    "tp_num_query_groups": "tp does not divide the query groups",
    "tp_ffn_hidden_size": "tp does not divide the MLP width",
    "pp_layers": "pp cannot split the layers",
    "batch": "the micro-batch does not divide the global batch per data-parallel rank",
    "vpp_layers": "pp × virtual_pp_size does not divide the layers",
    "vpp_microbatches": "the micro-batches per step are not a multiple of pp (interleaved schedule)",
    "memory": "does not fit in device memory less its headroom (the plan's estimate)",
}


@dataclass(frozen=True)
class Candidate:
    """One layout of the search: what it sets in the parallel, train and optim sections."""

    tp: int
    pp: int
    vpp: int
    micro_batch: int
    recompute: str
    distributed: bool
    sequence_parallel: bool
    first: int | None = None  # parallel.first_stage_layers (an uneven split), else None
    last: int | None = None  # parallel.last_stage_layers
    stages: tuple[int, ...] = ()  # an uneven split's layers per stage (for people)

    def overrides(self) -> dict[str, dict[str, Any]]:
        """The trainer sections' fields this layout sets (the same keys in the config and the trainer's
        dict: ``{"parallel": {"tp_size": 2, ...}, "train": {...}, "optim": {...}}``)."""
        train: dict[str, Any] = {"micro_batch_size": self.micro_batch,
                                 "recompute_granularity": self.recompute}
        if self.recompute == "full":
            train.update(recompute_method="uniform", recompute_num_layers=1)
        return {"parallel": {"tp_size": self.tp, "pp_size": self.pp, "virtual_pp_size": self.vpp,
                             "sequence_parallel": self.sequence_parallel, "first_stage_layers": self.first,
                             "last_stage_layers": self.last},
                "train": train, "optim": {"distributed": self.distributed}}

    @property
    def name(self) -> str:
        """Short, for tables: ``tp2 pp2 vpp2 mb4 rc-sel dopt``; an uneven split shows the layers of each
        stage, ``pp3[3+5+4]``, or of the first, the middle ones and the last, ``pp8[3+6×1+3]``."""
        c, pp = self.stages, f"pp{self.pp}"
        if c:
            pp += f"[{'+'.join(map(str, c))}]" if len(c) <= 4 else f"[{c[0]}+{len(c) - 2}×{c[1]}+{c[-1]}]"
        parts = [f"tp{self.tp}", pp] + ([f"vpp{self.vpp}"] if self.vpp > 1 else [])
        parts.append(f"mb{self.micro_batch}")
        parts += {"none": [], "selective": ["rc-sel"], "full": ["rc-full"]}[self.recompute]
        return " ".join(parts + (["dopt"] if self.distributed else []))



@dataclass(frozen=True)
class Ranked:
    candidate: Candidate
    dp: int
    memory: MemoryEstimate
    time: TimeEstimate


@dataclass(frozen=True)
class Dropped:
    candidate: Candidate
    code: str  # the plan's problem code (see _REASONS)
    detail: str  # the rule's own message


@dataclass
class Proposal:
    """The search's outcome: ranked (best first) and dropped (with why)."""

    nodes: int
    tasks_per_node: int
    global_batch: int
    ranked: list[Ranked] = field(default_factory=list)
    dropped: list[Dropped] = field(default_factory=list)

    @property
    def world(self) -> int:
        return self.nodes * self.tasks_per_node

    @property
    def searched(self) -> int:
        return len(self.ranked) + len(self.dropped)

    def trials(self, k: int) -> list[Ranked]:
        """What tune=true measures: the first ``k`` (all when fewer fit)."""
        return self.ranked[:k]

    def dropped_lines(self, examples: int = 2) -> list[str]:
        """Why the others were dropped: one line per rule with its count and a few examples."""
        groups: dict[str, list[Dropped]] = {}
        for d in self.dropped:
            groups.setdefault(d.code, []).append(d)
        lines = []
        for code, items in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            # Examples of different shapes (not the same layout with and without the optimizer option);
            # the rule's own message once, for the first.
            varied = list({(d.candidate.tp, d.candidate.pp, d.candidate.vpp, d.candidate.micro_batch): d
                           for d in reversed(items)}.values())[::-1][:examples]
            shown = ", ".join([f"{varied[0].candidate.name} ({varied[0].detail})",
                               *(d.candidate.name for d in varied[1:])])
            lines += textwrap.wrap(f"{len(items):5d} × {_REASONS.get(code, code)}: e.g. {shown}", width=106,
                                   initial_indent="    ", subsequent_indent=" " * 12)
        return lines


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def fixed_global_batch(cfg: SlipwayConfig) -> int:
    """The global batch every candidate keeps: train.global_batch_size, else the configured layout's
    (micro-batch × dp, the trainer's rule); 0 when neither is known (a problem)."""
    return cfg.train.global_batch_size or layout_of(cfg).global_batch


def apply(cfg: SlipwayConfig, cand: Candidate, global_batch: int, tasks: int) -> SlipwayConfig:
    """``cfg`` with ``cand``'s layout, the global batch and the tasks per node pinned (on the local executor
    without GPUs the tasks follow tp × pp: the world must not change with the candidate)."""
    over, c = cand.overrides(), cfg.cluster
    with deferred():  # the plan reports problems itself; a candidate config is only estimated here
        sections = {name: dataclasses.replace(getattr(cfg, name), **values) for name, values in over.items()}
        sections["train"] = dataclasses.replace(sections["train"], global_batch_size=global_batch)
        if c.tasks_per_node is None and not c.gpus_per_node:
            sections["cluster"] = dataclasses.replace(c, tasks_per_node=tasks)
        return dataclasses.replace(cfg, **sections)


def _splits(num_layers: int, pp: int) -> list[tuple[int | None, int | None, tuple[int, ...]]]:
    """(first_stage_layers, last_stage_layers, layers per stage) to try at ``pp`` stages: the even split
    where pp divides the layers; otherwise every uneven split Megatron's rule allows whose busiest stage
    holds the fewest layers (the one the schedule waits for), each spelled with the fewest fields. None
    fits: the even split, which the pipeline rule then drops with its reason."""
    if num_layers % pp == 0 or pp < 2:
        return [(None, None, ())]
    spellings = [(f, None) for f in range(1, num_layers)] + [(None, w) for w in range(1, num_layers)]
    spellings += [(f, w) for f in range(1, num_layers) for w in range(1, num_layers)] if pp > 2 else []
    found: dict[tuple[int, ...], tuple[int | None, int | None]] = {}
    for first, last in spellings:
        split = PipelineSplit(num_layers, pp, 1, first, last)
        if split.problem() is None:
            found.setdefault(tuple(split.stage_counts()), (first, last))
    if not found:
        return [(None, None, ())]
    least = min(max(counts) for counts in found)
    return [(*spelling, counts) for counts, spelling in found.items() if max(counts) == least]


def _grid(cfg: SlipwayConfig, world: int, tasks: int) -> list[Candidate]:
    a, seq = cfg.autotune, cfg.model.seq_length
    micro_batches = sorted(set(a.micro_batch_sizes) | {cfg.train.micro_batch_size} - {0})
    out = []
    for tp in _divisors(tasks):
        for pp in _divisors(world // tp):
            dp = world // (tp * pp)
            for first, last, stages in _splits(cfg.model.num_layers, pp):
                for vpp in (sorted(set(a.virtual_pp_sizes)) if pp > 1 else [1]):
                    for mb in micro_batches:
                        for rc in [r for r in RECOMPUTE_CHOICES if r in a.recompute]:
                            for dist in (sorted(set(a.distributed_optimizer)) if dp > 1 else [False]):
                                out.append(Candidate(tp, pp, vpp, mb, rc, dist, tp > 1 and seq % tp == 0,
                                                     first, last, stages))
    return out


def _rule_broken(cfg: SlipwayConfig, cand: Candidate, alt: SlipwayConfig) -> tuple[str, str] | None:
    """(code, message) of the first plan rule ``cand`` breaks (``alt``: the config with it applied)."""
    tp = cfg.model.tp_issues(cand.tp)
    if tp:
        return tp[0].code, tp[0].message
    split = pipeline_split(alt, cand.pp)
    if split is not None:
        return "pp_layers", split
    for issue in [*layout_problems(Context(alt)), *alt.parallel.problems(),
                  *alt.parallel.layer_issues(alt.model.num_layers), *alt.train.problems(),
                  *alt.optim.problems()]:
        return issue.code, f"{issue.key}={issue.value}: {issue.message}"
    return None


def _rank_key(r: Ranked) -> tuple:
    """Faster first; equal estimates (to 9 significant digits: the same sum in another order) to the
    layout with the most memory to spare (the module docstring)."""
    c, step = r.candidate, r.time.step_s
    return (float(f"{step:.9g}") if math.isfinite(step) else math.inf, r.memory.total_bytes, c.tp * c.pp,
            RECOMPUTE_CHOICES.index(c.recompute), c.distributed, c.vpp, c.tp, c.micro_batch)


def propose(cfg: SlipwayConfig, vocab: int) -> Proposal:
    """Search, check and rank (module docstring). ``vocab``: the resolved vocabulary (plan.resolve_vocab)."""
    tasks, nodes = tasks_per_node(cfg), cfg.cluster.nodes
    out = Proposal(nodes, tasks, fixed_global_batch(cfg))
    if not out.global_batch or cfg.model.problems():
        return out  # nothing to search: a problem says why (checks/layout.py auto_layout_problems)
    for cand in _grid(cfg, nodes * tasks, tasks):
        alt = apply(cfg, cand, out.global_batch, tasks)
        broken = _rule_broken(cfg, cand, alt)
        if broken is not None:
            out.dropped.append(Dropped(cand, *broken))
            continue
        lay = layout_of(alt)
        mem = estimate_memory(alt, vocab, lay)
        if not mem.fits:
            out.dropped.append(Dropped(cand, "memory", f"needs {fmt_bytes(mem.total_bytes).strip()} of "
                                                       f"{fmt_bytes(mem.limit_bytes).strip()}"))
            continue
        out.ranked.append(Ranked(cand, lay.dp, mem, estimate_time(alt, vocab, lay)))
    out.ranked.sort(key=_rank_key)
    return out


def _tok_s(p: Proposal, r: Ranked, seq: int) -> str:
    return f"{p.global_batch * seq / r.time.step_s:,.0f}" if r.time.known and r.time.step_s else "?"


def proposal_lines(cfg: SlipwayConfig, p: Proposal) -> list[str]:
    """The dry run's table: the first ``autotune.show`` ranked layouts with memory and estimate, which of
    them tune=true measures, and why the others were dropped."""
    a = cfg.autotune
    text = (f"Auto layout (layout=auto): world {p.world} = {p.nodes} node(s) × {p.tasks_per_node} task(s), "
            f"global batch {p.global_batch}; {p.searched} layouts searched, {len(p.ranked)} fit")
    if p.ranked and p.ranked[0].memory.device_bytes:
        m = p.ranked[0].memory
        text += (f" in {m.limit_bytes / GIB:.2f} of {m.device_bytes / GIB:.2f} GiB per device "
                 f"(cluster.memory_headroom={m.headroom:g})")
    head = textwrap.wrap(f"{text}; ranked by the plan's step-time estimate, equal estimates by memory:",
                         width=110, subsequent_indent="  ")
    if not p.ranked:
        dropped = ["  dropped:", *p.dropped_lines()] if p.dropped else []
        return [*head, "    none fits (see PROBLEMS)", *dropped]
    measured = len(p.trials(a.candidates)) if cfg.tune != "false" and len(p.ranked) > 1 else 0
    lines = [*head, f"    {'#':>3}  {'layout':<28}{'dp':>4}{'memory/device':>15}{'est. step':>12}"
                   f"{'est. tok/s':>13}"]
    for i, r in enumerate(p.ranked[:max(a.show, measured)]):
        step = f"{r.time.step_s:.4g} s" if r.time.known else "unknown"
        mark = "  ← first choice" if i == 0 else ""
        mark += "  (trial)" if i < measured else ""
        lines.append(f"    {i + 1:>3}  {r.candidate.name:<28}{r.dp:>4}{fmt_bytes(r.memory.total_bytes):>15}"
                     f"{step:>12}{_tok_s(p, r, cfg.model.seq_length):>13}{mark}")
    rest = len(p.ranked) - max(a.show, measured)
    if rest > 0:
        lines.append(f"    ... {rest} more that fit (ranked lower)")
    if len(p.ranked) == 1:
        lines.append("  one layout fits: training takes it (nothing to measure)")
    elif cfg.tune == "false":
        lines.append("  training takes the first choice (tune=true measures the first "
                     f"{a.candidates} in short trial jobs and takes the fastest)")
    else:
        lines.append(f"  tune={cfg.tune}: the first {measured} are measured ({a.warmup_iters} + {a.iters} "
                     "iterations each, after preprocessing); training takes the fastest")
    if p.dropped:
        lines += [f"  dropped ({len(p.dropped)}):", *p.dropped_lines()]
    return lines
