"""What the training-shaped jobs hand the trainer — the train stage's job and layout=auto's trials
(orchestrator/stages/tune.py) — built once: the trainer's config dict from the launch's config, the W&B
run name, and the torch.distributed environment a task exports from its Slurm (or local) job."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from orchestrator.base.facts import PlanInputs
from orchestrator.base.plan_types import StagePlan
from orchestrator.base.schema import SlipwayConfig
from orchestrator.stages import preprocess
from trainer.config import RunConfig
from trainer.data.blend import BlendError
from trainer.formulas import master_port
from trainer.run_files import RunDir, document_prefix


def run_name(cfg: SlipwayConfig, facts: PlanInputs) -> str:
    if cfg.logging.wandb.name:
        return cfg.logging.wandb.name
    if facts.sweep and facts.sweep.overrides:
        return f"{facts.run_id}:{','.join(facts.sweep.overrides)}"
    return facts.run_id


def trainer_config(cfg: SlipwayConfig, facts: PlanInputs, prep: StagePlan) -> dict[str, Any]:
    """The dict handed to ``trainer.config.RunConfig.from_dict``: every trainer section as the user set it
    (the schema's root is RunConfig, so nothing is copied field by field), with what the plan derives put
    in: the preprocessed dataset prefixes, the tokenizer files, the run's paths and W&B names."""
    out = {f.name: dataclasses.asdict(getattr(cfg, f.name)) if dataclasses.is_dataclass(getattr(cfg, f.name))
           else getattr(cfg, f.name) for f in dataclasses.fields(RunConfig)}
    # The files the data was tokenized with (no inputs at all is a plan problem: the config's, then).
    tok = (prep.job[0].vocab_file, prep.job[0].merge_file) if prep.job else (
        cfg.tokenizer.vocab_file, cfg.tokenizer.merge_file)
    prefixes = [document_prefix(p, cfg.data.json_key) for p in preprocess.prefixes(prep.job)]
    try:  # a blend's weights go with the prefixes of the same inputs (a broken blend is a plan problem)
        out["data"]["paths"] = cfg.data.blend().with_paths(prefixes).spelled()
    except BlendError:
        out["data"]["paths"] = prefixes
    out["tokenizer"].update(vocab_file=tok[0], merge_file=tok[1])
    out["checkpoint"]["dir"] = cfg.checkpoint.dir or str(RunDir(facts.run_dir).checkpoints)
    wandb = out["logging"]["wandb"]
    wandb["group"] = wandb["group"] or (facts.sweep.sweep_id if facts.sweep else None)
    wandb["name"] = run_name(cfg, facts)
    out.update(run_dir=facts.run_dir, run_id=facts.run_id)
    return out


def export_torch_env() -> None:
    """RANK/WORLD_SIZE/MASTER_* from the Slurm (or local) job; the sbatch script sets MASTER_ADDR/PORT."""
    import submitit

    env = submitit.helpers.TorchDistributedEnvironment()
    local = os.environ.get("SUBMITIT_EXECUTOR") == "local"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1" if local else env.master_addr)
    # Not submitit's own pick (anywhere in 20000-60000, so often in the kernel's ephemeral range): the job
    # script's formula, from the job's own id (one per array task; the local executor's is its pid).
    os.environ.setdefault("MASTER_PORT", str(master_port(int(submitit.JobEnvironment().raw_job_id))))
    os.environ.update(RANK=str(env.rank), WORLD_SIZE=str(env.world_size), LOCAL_RANK=str(env.local_rank),
                      LOCAL_WORLD_SIZE=str(env.local_world_size))
