"""The parallel layout and the batch: tensor-parallel size against the heads, the world against tp·pp,
the global batch against micro-batches × dp, the interleaved schedule's constraints, sequence parallelism.
(The layers against pp_size, the uneven split and the model chunks are the parallel section's own rule,
ParallelConfig.layer_issues.)"""

from __future__ import annotations

from dataclasses import replace

from orchestrator.base.layout import Layout
from orchestrator.base.plan_types import Context
from orchestrator.base.problems import Problem
from orchestrator.base.schema import SlipwayConfig


def pipeline_split(cfg: SlipwayConfig, pp: int) -> str | None:
    """Why ``pp`` pipeline stages cannot split this model's layers, or None when they can: the one
    question the layout search (orchestrator/planning/autolayout.py) asks of a pipeline size. The rule is the
    parallel section's own (``ParallelConfig.layer_issues``: equal shares, or the uneven split the config
    asks for), asked before model chunks, which the search varies separately."""
    parallel = replace(cfg.parallel, pp_size=pp, virtual_pp_size=1)
    if pp < 2:
        parallel = replace(parallel, first_stage_layers=None, last_stage_layers=None)
    issues = parallel.layer_issues(cfg.model.num_layers)
    return issues[0].message if issues else None


def layout_problems(ctx: Context) -> list[Problem]:
    cfg, lay = ctx.cfg, ctx.layout
    m, p, t = cfg.model, cfg.parallel, cfg.train
    out = []
    if p.tp_size > 0 and m.num_attention_heads % p.tp_size:
        out.append(
            Problem(
                "tp_heads",
                "parallel.tp_size",
                p.tp_size,
                f"model.num_attention_heads={m.num_attention_heads} is not divisible by it",
                "choose a tp_size that divides the number of heads",
            )
        )
    # Grouped-query attention: tp must divide the KV groups too (the model section's own rule).
    out += [Problem(i.code, i.key, i.value, i.message, i.fix) for i in m.tp_issues(p.tp_size)
            if i.code == "tp_num_query_groups" and m.query_groups != m.num_attention_heads]
    if lay.dp == 0 and p.tp_size > 0 and p.pp_size > 0:
        out.append(
            Problem(
                "world",
                "cluster.nodes",
                cfg.cluster.nodes,
                f"world = nodes {lay.nodes} × tasks_per_node {lay.tasks_per_node} = {lay.world} is not a "
                f"multiple of tp {p.tp_size} × pp {p.pp_size} = {p.tp_size * p.pp_size}",
                "change cluster.nodes / cluster.gpus_per_node (or cluster.tasks_per_node) or the tp/pp sizes",
            )
        )
    elif lay.dp and lay.num_microbatches == 0 and t.micro_batch_size > 0:
        need = t.micro_batch_size * lay.dp
        out.append(
            Problem(
                "batch",
                "train.global_batch_size",
                t.global_batch_size,
                f"not divisible by micro_batch_size {t.micro_batch_size} × dp {lay.dp} = {need}",
                f"use a multiple of {need}, e.g. {max(need, (t.global_batch_size // need) * need)}",
            )
        )
    out += _virtual_pipeline(cfg, lay)
    if p.sequence_parallel and p.tp_size < 2:
        out.append(
            Problem(
                "sequence_parallel",
                "parallel.sequence_parallel",
                True,
                "sequence parallelism splits along the tensor-parallel group, which has size 1",
                "set parallel.sequence_parallel=false or parallel.tp_size>1",
            )
        )
    return out


def _virtual_pipeline(cfg: SlipwayConfig, lay: Layout) -> list[Problem]:
    """The interleaved schedule's batch constraint (Megatron's): micro-batches in groups of pp_size (the
    schedule runs each chunk on a group of p micro-batches in turn). Equal chunks of layers
    (ParallelConfig.layer_issues, ``vpp_layers``) and v > 1 with pp_size 1 are ParallelConfig's own."""
    p, v, out = cfg.parallel, cfg.parallel.virtual_pp_size, []
    if not isinstance(v, int) or v < 2 or p.pp_size < 2:
        return out
    if lay.num_microbatches and lay.num_microbatches % p.pp_size:
        need = cfg.train.micro_batch_size * lay.dp * p.pp_size
        out.append(Problem("vpp_microbatches", "train.global_batch_size", cfg.train.global_batch_size,
                           f"gives {lay.num_microbatches} micro-batches per step, not a multiple of "
                           f"parallel.pp_size={p.pp_size} as the interleaved schedule needs",
                           f"use a multiple of micro_batch_size × dp × pp_size = {need}, e.g. "
                           f"{max(need, (lay.global_batch // need) * need)}, or parallel.virtual_pp_size=1"))
    return out


def auto_layout_problems(ctx: Context) -> list[Problem]:
    """layout=auto and tune: the search found a layout that fits (the plan's proposal, orchestrator/
    autolayout.py), and tune measures only such a search."""
    cfg, out = ctx.cfg, []
    if cfg.tune != "false" and cfg.layout != "auto":
        out.append(Problem("tune_manual", "tune", cfg.tune, "measures the candidate layouts of layout=auto; "
                           "this run's layout is manual (the parallel section as set)",
                           "add layout=auto, or drop tune"))
    p = ctx.proposal
    if cfg.layout != "auto" or p is None or p.ranked:
        return out
    if not p.global_batch:
        return out + [Problem("auto_batch", "train.global_batch_size", None, "layout=auto keeps the global "
                              "batch and searches the rest, but none is set and the configured layout gives "
                              "none", "set train.global_batch_size")]
    if not p.searched:
        return out  # the model's own problems say why nothing could be searched
    why = "; ".join(line.strip() for line in p.dropped_lines(examples=1))
    return out + [Problem("auto_layout", "layout", "auto", f"none of the {p.searched} layouts of world "
                          f"{p.world} and global batch {p.global_batch} is accepted: {why}",
                          "give the run more devices (cluster.gpus or cluster.nodes), widen the search "
                          "(autotune.micro_batch_sizes, autotune.recompute), or shorten model.seq_length")]
