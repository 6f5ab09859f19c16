"""A stage defined in one file, outside orchestrator/stages/: it counts the documents and tokens of the
run's preprocessed data into ``<run_dir>/stages/tokencount/counts.json`` and shows that file in ``status``.
``register(STAGE)`` adds it; tests/orchestrator/test_toy_stage.py plans, renders, runs and reads it back."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from orchestrator.base.plan_types import StagePlan
from orchestrator.stages import preprocess
from orchestrator.stages.base import NodeStage, PlanContext, StageDef, StageLook, stable_hash
from trainer.run_files import RunDir

NAME = "tokencount"
COUNTS = "counts.json"


@dataclass
class CountJob:
    prefixes: list[str]  # the datasets' .bin/.idx prefixes
    out: str


class CountStage(NodeStage):
    def run(self) -> dict[str, Any]:
        from trainer.data.indexed_dataset import IndexedDataset

        job: CountJob = self.job
        counts = {}
        for prefix in job.prefixes:
            ds = IndexedDataset(prefix)
            counts[os.path.basename(prefix)] = {"documents": len(ds), "tokens": ds.num_tokens}
            ds.close()
        os.makedirs(os.path.dirname(job.out), exist_ok=True)
        with open(job.out, "w") as f:
            json.dump(counts, f)
        return counts


class TokenCount(StageDef):
    name = NAME
    after = (preprocess.NAME,)
    node = CountStage

    def plan(self, ctx: PlanContext) -> StagePlan:
        prep = ctx.planned[preprocess.NAME]
        prefixes = [c.output_prefix_for(key) for c in prep.job for key in c.json_keys]
        state = str(ctx.run.stage_state(NAME))
        return StagePlan(NAME, stable_hash({"data": prep.key}), state, False, (preprocess.NAME,),
                         CountJob(prefixes, os.path.join(state, COUNTS)))

    def status(self, look: StageLook) -> dict[str, Any]:
        return {"log": str(RunDir(look.run_dir).stage_state(NAME) / COUNTS)}


STAGE = TokenCount()
