"""The convert stage (``convert.enabled``): the run's latest checkpoint to a verified Hugging Face model in
``<run_dir>/hf`` and a greedy sample, after training. Its job is the hook's own
:class:`~trainer.convert.run_config.ConvertRunConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.base.plan_types import StagePlan
from orchestrator.base.schema import SlipwayConfig
from orchestrator.stages import train
from orchestrator.stages.base import STAGE_MEM_GB, NodeStage, PlanContext, StageDef, model_params, stable_hash
from trainer.convert.run_config import ConvertRunConfig
from trainer.data.hf_tokenizer import HF_TOKENIZER_TYPE

NAME = "convert"


@dataclass
class ConvertJob:
    run_dir: str
    config: ConvertRunConfig  # the hook's own config (trainer/convert/run_config.py), built by the plan


class ConvertStage(NodeStage):
    def run(self) -> dict[str, Any]:
        from trainer.convert import convert_run

        job: ConvertJob = self.job
        result = convert_run(job.run_dir, job.config)
        return {"hf": job.config.output_dir, "result": str(result), "iteration": result.provenance.iteration}


class Convert(StageDef):
    name = NAME
    after = (train.NAME,)
    node = ConvertStage

    def plan(self, ctx: PlanContext) -> StagePlan | None:
        cfg = ctx.cfg
        if not cfg.convert.enabled:
            return None
        trained = ctx.planned[train.NAME]
        tcfg = trained.job.trainer_config
        key = stable_hash({"train": trained.key, "verify": cfg.convert.verify, "code": ctx.code("trainer")})
        tok = cfg.tokenizer
        job = ConvertJob(ctx.facts.run_dir, ConvertRunConfig(
            checkpoint_dir=tcfg["checkpoint"]["dir"], output_dir=str(ctx.run.hf),
            vocab_file=tcfg["tokenizer"]["vocab_file"], merge_file=tcfg["tokenizer"]["merge_file"],
            tokenizer_model=tok.model if tok.type == HF_TOKENIZER_TYPE else None, verify=cfg.convert.verify,
            # The sample generated after conversion must fit the model's positions (prompt included).
            sample_tokens=max(1, min(64, cfg.model.max_position_embeddings // 4))))
        return StagePlan(NAME, key, str(ctx.run.stage_state(NAME)), False, (train.NAME,), job)

    def mem_gb(self, cfg: SlipwayConfig) -> float:
        """The checkpoint with its optimizer state (up to 16 bytes per parameter), the converted fp32 model
        and the checkpoint's model it is verified against (4 each), on top of torch and transformers (a
        tiny model's conversion and verification ran within 2 GB on the devcluster, its memory enforced)."""
        return STAGE_MEM_GB + 24 * model_params(cfg) / 1e9

    def outputs(self, stage: StagePlan) -> list[Path]:
        """The converted model's config (written last of its files): a deleted hf/ converts again."""
        return [Path(stage.job.config.output_dir, "config.json")]


STAGE = Convert()
