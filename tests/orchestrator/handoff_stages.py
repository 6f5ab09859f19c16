"""Two stages defined outside orchestrator/stages/, as a site adds one (``orchestrator.stages.register``),
for the multi-node tests' negative control (tests/orchestrator/test_multinode.py): ``handoff_write`` leaves
a file for the next stage in node-local /tmp (its output folder is there: the mistake under test), and
``handoff_read``, after it, reads it on both nodes of the cpu partition. The node that did not write it
cannot see it: the stage base's wait for upstream output (orchestrator/stages/upstream.py, UpstreamNotVisible)
fails there, naming the folder and the node. Both plan only for a run whose id is :data:`RUN`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orchestrator.base.plan_types import JobResources, StagePlan
from orchestrator.base.schema import SlipwayConfig
from orchestrator.stages.base import NodeStage, PlanContext, StageDef, common_resources, stable_hash
from trainer.health import node_name

RUN = "nodelocal"
WRITE, READ = "handoff_write", "handoff_read"
FILE = "handoff.txt"


def handoff_dir(run_dir: str) -> Path:
    """The writer's output folder: in /tmp, each node's own on the devcluster (and on most sites)."""
    return Path("/tmp") / f"slipway-handoff-{stable_hash(run_dir, 8)}"


class WriteStage(NodeStage):
    def run(self) -> dict[str, Any]:
        path = Path(self.output_dir) / FILE
        path.parent.mkdir(parents=True, exist_ok=True)  # the launch made it on the login node's /tmp
        path.write_text(node_name())
        return {"wrote": str(path), "node": node_name()}


class ReadStage(NodeStage):
    def run(self) -> dict[str, Any]:
        return {"read": (Path(self.job) / FILE).read_text(), "node": node_name()}


class HandoffWrite(StageDef):
    name = WRITE
    node = WriteStage

    def plan(self, ctx: PlanContext) -> StagePlan | None:
        if ctx.facts.run_id != RUN:
            return None
        out = str(handoff_dir(ctx.facts.run_dir))
        return StagePlan(WRITE, stable_hash({"write": out}), out, False, (), out)


class HandoffRead(StageDef):
    name = READ
    after = (WRITE,)
    node = ReadStage

    def plan(self, ctx: PlanContext) -> StagePlan | None:
        write = ctx.planned.get(WRITE)
        if write is None:
            return None
        return StagePlan(READ, stable_hash({"read": write.key}), str(ctx.run.stage_state(READ)), False,
                         (WRITE,), write.state_dir)

    def resources(self, cfg: SlipwayConfig, tasks_per_node: int) -> JobResources:
        """One task on each of two nodes: one of them is not the writer's."""
        c = cfg.cluster
        return JobResources(READ, 2, 1, 0, 1, c.stage_time_limit_min, c.stage_partition or c.partition,
                            **common_resources(cfg))


STAGES = (HandoffWrite(), HandoffRead())
