"""The eval stage (``eval.enabled``, after convert): HumanEval pass@k and held-out perplexity of
``<run_dir>/hf``, in ``<run_dir>/eval``. Its job is the trainer's own :class:`~trainer.eval.config.EvalRun`;
``status`` shows pass@1, and a sweep's best point by it."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from orchestrator.base.plan_types import JobResources, StagePlan
from orchestrator.base.schema import SlipwayConfig
from orchestrator.render import mem_flag
from orchestrator.stages import convert, train
from orchestrator.stages.base import (
    STAGE_MEM_GB,
    NodeStage,
    PlanContext,
    StageDef,
    StageLook,
    common_resources,
    model_params,
    stable_hash,
    stage_mem_gb,
)
from trainer.config_issues import deferred
from trainer.data.blend import blend_paths
from trainer.eval.config import EvalConfig, EvalRun
from trainer.eval.results import RESULTS_FILE, pass_at_1, read_results

NAME = "eval"


class EvalStage(NodeStage):
    """HumanEval and perplexity of <run_dir>/hf (trainer/eval); a failed sample is a result, not an error."""

    def run(self) -> dict[str, Any]:
        from trainer.eval.results import flat_metrics
        from trainer.eval.run import run_eval

        run: EvalRun = self.job  # the trainer's own spec, built by the plan
        return {"results": os.path.join(run.out_dir, RESULTS_FILE), **flat_metrics(run_eval(run))}


class Eval(StageDef):
    name = NAME
    after = (convert.NAME,)
    node = EvalStage

    def plan(self, ctx: PlanContext) -> StagePlan | None:
        """Keyed by the converted model and the settings (how many sandboxes run at once changes no
        result). Held-out perplexity reads the first dataset (several are merged for training)."""
        cfg, converted = ctx.cfg, ctx.planned.get(convert.NAME)
        if not cfg.eval.enabled or converted is None:
            return None
        settings = dataclasses.asdict(cfg.eval)
        key = stable_hash({"convert": converted.key,
                           "eval": {k: v for k, v in settings.items() if k != "workers"}})
        tcfg = ctx.planned[train.NAME].job.trainer_config
        paths = blend_paths(tcfg["data"]["paths"])  # a blend's first entry is a weight
        first = paths[0] if paths else None  # no data is a plan problem (checks/data.py), not a crash here
        with deferred():  # a refused eval section is one of the plan's problems, not an exception here
            checked = EvalConfig(**settings)
        job = EvalRun(converted.job.config.output_dir, str(ctx.run.eval), checked, first, cfg.data.split,
                      cfg.model.seq_length, cfg.data.json_key, ctx.facts.run_dir, ctx.facts.run_id,
                      tcfg["logging"]["wandb"])
        return StagePlan(NAME, key, str(ctx.run.stage_state(NAME)), False, (convert.NAME,), job)

    def resources(self, cfg: SlipwayConfig, tasks_per_node: int) -> JobResources:
        """One task; with ``eval.device=cuda`` one GPU on the training partition."""
        c, gpu = cfg.cluster, cfg.eval.device == "cuda"
        partition = c.partition if gpu else c.stage_partition or c.partition
        return JobResources(NAME, 1, 1, int(gpu), c.stage_cpus, cfg.eval.time_limit_min,
                            partition, mem=mem_flag(stage_mem_gb(cfg, self)), **common_resources(cfg))

    def mem_gb(self, cfg: SlipwayConfig) -> float:
        """The converted model (fp32, plus a copy while it loads) and a process per eval.workers that runs
        the generated programs, on top of torch and transformers."""
        return STAGE_MEM_GB + 8 * model_params(cfg) / 1e9 + 0.5 * cfg.eval.workers

    def status(self, look: StageLook) -> dict[str, Any]:
        return {"pass_at_1": pass_at_1(read_results(look.run_dir))}

    def outputs(self, stage: StagePlan) -> list[Path]:
        return [Path(stage.job.out_dir, RESULTS_FILE)]


STAGE = Eval()
