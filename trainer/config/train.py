"""The ``train`` and ``optim`` sections (torch-free): the loop's settings and the optimizer's."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainer.config_issues import ConfigIssue, Section, choice, issue, positive
from trainer.health.config import HealthConfig

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class PrecisionFacts:
    """What one ``train.precision`` is, for the plan's estimates and notes (:data:`PRECISION_FACTS`)."""

    element_bytes: int  # an activation in the compute dtype: what tensor and pipeline parallelism move
    loss_scaling: bool  # needs dynamic loss scaling (fp16's 5-bit exponent underflows small gradients)
    where: str  # the devices it is the usual choice on, and why


PRECISION_FACTS = {
    "fp32": PrecisionFacts(4, False, "CPUs and numerics checks (GPUs run it without tensor cores)"),
    "bf16": PrecisionFacts(2, False, "GPUs with bf16, Ampere and newer (fp32's exponent range, no loss "
                                     "scaling)"),
    "fp16": PrecisionFacts(2, True, "GPUs without bf16, V100 and older (the CodeParrot guide's choice, from "
                                    "before bf16 was the default)"),
}
"""The one table of what each precision is (the plan's notes, orchestrator/planning/plan_format.py, and the
estimate's activation bytes, orchestrator/base/estimate.py)."""
DECAY_STYLES = ("cosine", "linear", "constant", "inverse-square-root")
OPTIM_IMPLS = ("auto", "apex", "csrc", "torch_fused", "foreach", "for_loop")
DEVICES = ("auto", "cpu", "cuda")
RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
KERNEL_CHECK_POLICIES = ("fallback", "fail", "off")
PRECISION_RECIPES = ("auto", "autocast", "master_weights")
DEFAULT_RECIPE = "autocast"
"""What ``train.precision_recipe=auto`` runs without the distributed optimizer. Stays autocast until an
H200 measurement (bench/gpu_check.sh, recipe rows) shows master_weights faster at equal loss."""


def precision_recipe(precision: str, recipe: str, distributed: bool) -> str:
    """The recipe a run uses: ``fp32`` (every tensor fp32), ``autocast`` or ``master_weights``
    (``train.precision_recipe`` resolved; the distributed optimizer always keeps 16-bit parameters)."""
    if precision == "fp32":
        return "fp32"
    if recipe == "auto":
        return "master_weights" if distributed else DEFAULT_RECIPE
    return recipe


def recipe_line(precision: str, recipe: str, distributed: bool) -> str:
    """One line naming the recipe (the plan and the trainer's start-up log print it)."""
    chosen = precision_recipe(precision, recipe, distributed)
    why = " (auto)" if recipe == "auto" and chosen != "fp32" else ""
    return {"fp32": "fp32 (parameters, activations and gradients in fp32)",
            "autocast": f"{precision} autocast{why}: fp32 parameters, gradients and optimizer; forward in "
                        f"{precision}",
            "master_weights": f"{precision} master_weights{why}: {precision} parameters and activations, "
                              "fp32 master weights and gradient accumulation in the optimizer (Megatron's "
                              f"--{precision})"}[chosen]


@dataclass
class TrainConfig(HealthConfig):
    """Batch sizes, length, precision, and the save/eval/log cadence (all counted in iterations)."""

    micro_batch_size: int = 1
    """Sequences per forward/backward pass on one data-parallel rank."""
    global_batch_size: int | None = None
    """Sequences per optimizer step over all ranks; a multiple of micro_batch_size × dp (the rest is
    gradient accumulation, or the pipeline's micro-batches); null: micro_batch_size × dp."""
    iters: int = 1000
    """Optimizer steps in the whole run (requeues and retries included)."""
    precision: str = "fp32"
    """fp32, bf16 or fp16 (dynamic loss scaling; needs GPUs); how bf16/fp16 are applied is
    precision_recipe."""
    precision_recipe: str = "auto"
    """bf16/fp16 only (fp32 ignores it). autocast: fp32 parameters, gradients and optimizer, the forward
    under torch.autocast, every activation (the residual stream included) in bf16/fp16. master_weights:
    Megatron's --bf16/--fp16 — bf16/fp16 parameters and activations, no autocast, fp32 master weights and
    fp32 gradient accumulation in the optimizer; it uses the distributed optimizer's layout (ZeRO-1 over
    the data-parallel ranks, whole-model at dp 1; checkpoints hold 16-bit weights and distrib_optim.pt),
    so optim.impl must be auto, csrc, foreach or for_loop; 2 + 4 + 12/dp bytes of state per parameter
    instead of 16. auto: master_weights under optim.distributed, else autocast (bench/gpu_check.sh
    measures both on one H200; the faster at equal loss becomes auto's choice). The plan and the job's
    first log lines name the recipe."""
    seed: int = 1234
    """Seed of the initialisation, the data order and dropout; the same seed gives the same model under
    every (tp, pp) layout."""
    save_interval: int | None = None
    """Iterations between checkpoints (one is also saved on a stop signal and at the end); null: only
    those."""
    eval_interval: int | None = 1000
    """Iterations between validation passes; null: no validation."""
    eval_iters: int = 10
    """Validation batches per validation pass."""
    log_interval: int = 10
    """Iterations between log lines (loss, learning rate, tokens/s, TFLOP/s, MFU) and W&B points."""
    deterministic: bool = False
    """Deterministic algorithms: bitwise-reproducible steps and resumes (used by the resume tests;
    slower on GPU)."""
    device: str = "auto"
    """auto (CUDA when available, else CPU), cpu or cuda."""
    initial_loss_scale: float = 2.0**32
    """fp16: the dynamic loss scale to start from (Megatron's default 2^32)."""
    loss_scale_window: int = 1000
    """fp16: steps without overflow before the loss scale doubles."""
    hysteresis: int = 2
    """fp16: overflows tolerated before the loss scale halves."""
    min_loss_scale: float = 1.0
    """fp16: the loss scale never goes below this."""
    recompute_granularity: str = "none"
    """Activation recomputation (Megatron's --recompute-granularity): none; selective (the core attention
    — scores, softmax, dropout, ·V — recomputed in backward; little gain with SDPA's flash/efficient GPU
    kernels, which never store those); full (whole layers, see recompute_method). Same math: losses are
    bit-identical to none."""
    recompute_method: str = "uniform"
    """full: uniform (the stage's layers in groups of recompute_num_layers, each keeping only its input) or
    block (only the first recompute_num_layers layers of each stage recomputed)."""
    recompute_num_layers: int = 1
    """full: the group size (uniform) or the number of recomputed layers per stage (block)."""
    kernel_check: str = "fallback"
    """Before the first step, every op the kernels key resolved to a fused implementation (csrc, apex,
    compile) runs once, forward and backward, on this job's device and dtypes against its eager
    reference (trainer/ops/selfcheck.py; its cost: bench/README.md). fallback: an op that raises or
    disagrees uses the eager reference for this run, with a warning and a record (log lines, the metrics
    file, status, summary); fail: the job stops before step 1 naming the op (not retried; for CI of a
    site image); off: no check."""

    def problems(self) -> list[ConfigIssue]:
        out = super().problems()
        for name in ("micro_batch_size", "iters", "log_interval", "loss_scale_window", "hysteresis"):
            out += positive(f"train.{name}", getattr(self, name))
        for name in ("global_batch_size", "save_interval", "eval_interval"):
            out += positive(f"train.{name}", getattr(self, name), allow_none=True)
        if self.eval_iters < 0:
            out.append(issue("positive", "train.eval_iters", self.eval_iters, "must be 0 or more",
                             "set train.eval_iters to 0 or more"))
        out += choice("train.precision", self.precision, PRECISIONS)
        out += choice("train.precision_recipe", self.precision_recipe, PRECISION_RECIPES)
        out += choice("train.device", self.device, DEVICES)
        out += choice("train.recompute_granularity", self.recompute_granularity, RECOMPUTE_GRANULARITIES)
        out += choice("train.recompute_method", self.recompute_method, RECOMPUTE_METHODS)
        out += positive("train.recompute_num_layers", self.recompute_num_layers)
        out += choice("train.kernel_check", self.kernel_check, KERNEL_CHECK_POLICIES)
        if not 0 < self.min_loss_scale <= self.initial_loss_scale:
            out.append(issue("loss_scale", "train.min_loss_scale", self.min_loss_scale,
                             f"must be in (0, initial_loss_scale={self.initial_loss_scale}]",
                             "lower train.min_loss_scale"))
        return out

    def health(self) -> HealthConfig:
        """The heartbeat/watchdog/preflight slice."""
        return HealthConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(HealthConfig)})


@dataclass
class OptimConfig(Section):
    """AdamW (Megatron's defaults) and the learning-rate schedule."""

    lr: float = 3.0e-4
    """Peak learning rate, reached at the end of the warm-up."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay (kept after it); at most lr."""
    warmup_iters: int = 0
    """Iterations of linear warm-up from 0 to lr."""
    decay_iters: int | None = None
    """Iterations from the start to the end of the decay; null: train.iters."""
    decay_style: str = "cosine"
    """Decay from lr to min_lr: cosine, linear, constant or inverse-square-root."""
    weight_decay: float = 0.01
    """Decoupled (AdamW) weight decay; not applied to biases and LayerNorm weights (Megatron: 0.01)."""
    adam_beta1: float = 0.9
    """Adam's first-moment decay."""
    adam_beta2: float = 0.999
    """Adam's second-moment decay."""
    adam_eps: float = 1.0e-8
    """Adam's epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""
    impl: str = "auto"
    """AdamW implementation: auto (apex FusedAdam on CUDA when importable, else torch fused on CUDA,
    else Slipway's csrc kernel or foreach), apex, csrc, torch_fused, foreach or for_loop."""
    distributed: bool = False
    """The distributed optimizer (ZeRO-1, Megatron's --use-distributed-optimizer): Adam moments and the fp32
    master weights sharded over the data-parallel ranks, gradients reduce-scattered (instead of
    all-reduced) into each rank's shard, the step on the shard, updated weights all-gathered; bf16/fp16
    then keep 16-bit weights with fp32 gradient buffers (Megatron's layout). Bytes per parameter: fp32
    4 + 4 + 8/dp, bf16/fp16 2 + 4 + 12/dp, instead of 16. Costs an all-gather of the weights per step
    (the reduce-scatter costs what the all-reduce did) and, at save, gathering the state to DP rank 0
    (distrib_optim.pt beside each shard). impl must be auto, csrc, foreach or for_loop."""

    def problems(self) -> list[ConfigIssue]:
        out = positive("optim.lr", self.lr)
        if self.min_lr < 0 or self.min_lr > self.lr:
            out.append(issue("lr_range", "optim.min_lr", self.min_lr, f"must be in [0, optim.lr={self.lr}]",
                             "set optim.min_lr <= optim.lr"))
        if self.warmup_iters < 0:
            out.append(issue("positive", "optim.warmup_iters", self.warmup_iters, "must be 0 or more",
                             "set optim.warmup_iters >= 0"))
        if self.decay_iters is not None and self.decay_iters < self.warmup_iters:
            out.append(issue("warmup", "optim.warmup_iters", self.warmup_iters,
                             f"exceeds the decay length optim.decay_iters={self.decay_iters}",
                             "lower optim.warmup_iters"))
        out += choice("optim.decay_style", self.decay_style, DECAY_STYLES)
        out += choice("optim.impl", self.impl, OPTIM_IMPLS)
        if self.distributed and self.impl in ("apex", "torch_fused"):
            out.append(issue("distributed_impl", "optim.impl", self.impl,
                             "steps whole parameters and cannot step the distributed optimizer's flat "
                             "shards (optim.distributed=true)",
                             "set optim.impl to auto, csrc, foreach or for_loop, or optim.distributed=false"))
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                out.append(issue("range", f"optim.{name}", getattr(self, name), "must be in [0, 1)",
                                 f"set optim.{name}=0.9"))
        for name in ("weight_decay", "clip_grad"):
            if getattr(self, name) < 0:
                out.append(issue("range", f"optim.{name}", getattr(self, name), "must be >= 0",
                                 f"set optim.{name} to 0 or more"))
        return out + positive("optim.adam_eps", self.adam_eps)
