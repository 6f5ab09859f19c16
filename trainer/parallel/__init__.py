"""trainer.parallel: Megatron-style tensor, sequence, pipeline and data parallelism on torch.distributed.

The training loop's API (see trainer.parallel.engine for a worked loop):

- ``init_distributed(pcfg) -> ParallelState`` — from torchrun/Slurm env, or a world of one.
- ``build_model(gpt_cfg, pcfg, pstate, seed) -> ParallelModel`` — this rank's stage and TP shard.
- the batch rules (global batch, micro-batches per step) are trainer.formulas'.
- ``train_step(model, batches) -> loss`` — forward+backward (1F1B or AFAB; interleaved over v model
  chunks per stage with ``parallel.virtual_pp_size`` > 1, trainer.parallel.interleaved) and full
  gradient sync.
- ``clip_grad_norm(model, max_norm) -> norm``; ``grad_norm(model)``.
- ``eval_step(model, batches) -> loss``; ``finish_grad_sync(model)`` for custom schedules.
"""

from trainer.config.model import ParallelConfig
from trainer.parallel.engine import ParallelModel, build_model, eval_step, finish_grad_sync, train_step
from trainer.parallel.grad_norm import clip_grad_norm, grad_norm
from trainer.parallel.launch import dist_env, init_distributed
from trainer.parallel.state import Group, ParallelState, check_layout

__all__ = ["Group", "ParallelConfig", "ParallelModel", "ParallelState", "build_model", "check_layout",
           "clip_grad_norm", "dist_env", "eval_step", "finish_grad_sync", "grad_norm", "init_distributed",
           "train_step"]
