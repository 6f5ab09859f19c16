"""The run's parallel layout derived from the config: tasks per node, world size, tp × pp × dp, micro-batches.

Pure and small, so planning, estimates, validation and submission share one derivation.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.base.schema import SlipwayConfig
from trainer.formulas import global_batch_size, microbatches_per_step


@dataclass(frozen=True)
class Layout:
    """Derived sizes of a run: world = nodes × tasks_per_node = tp × pp × dp."""

    nodes: int
    tasks_per_node: int
    world: int
    tp: int
    pp: int
    dp: int  # 0 when world is not a multiple of tp·pp
    num_microbatches: int  # 0 when global batch is not a multiple of micro × dp
    global_batch: int  # train.global_batch_size, or micro × dp when that is null (the trainer's rule)


def tasks_per_node(cfg: SlipwayConfig) -> int:
    """Training tasks per node: as configured, else one per GPU; on the local executor without GPUs,
    tp × pp processes (one model replica) so the smoke layout runs on any machine."""
    c = cfg.cluster
    if c.tasks_per_node is not None:
        return c.tasks_per_node
    if c.gpus_per_node:
        return c.gpus_per_node
    return max(cfg.parallel.tp_size * cfg.parallel.pp_size, 1) if c.executor == "local" else 1


def layout_of(cfg: SlipwayConfig) -> Layout:
    c, p, t = cfg.cluster, cfg.parallel, cfg.train
    tpn = tasks_per_node(cfg)
    world = c.nodes * tpn
    mp = max(p.tp_size, 1) * max(p.pp_size, 1)
    dp = world // mp if world % mp == 0 else 0
    gbs = global_batch_size(t.global_batch_size, t.micro_batch_size, dp)  # the trainer's rule
    return Layout(c.nodes, tpn, world, p.tp_size, p.pp_size, dp,
                  microbatches_per_step(gbs, t.micro_batch_size, dp), gbs)
