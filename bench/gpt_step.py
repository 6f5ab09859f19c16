"""The real training step of a named GPT in this process, for the benchmarks that time or profile it
(bench/step_profile.py, bench/train_gpu.py's ``loop`` modes): ``trainer.run.entry.build_components`` (the
recipe, the kernel set and its self-check, the optimizer of the run) and ``trainer.run.loop.step`` (the
engine's train_step, unscale, the global norm and clipping, AdamW, the LR schedule) on random tokens,
on one device. What ``python -m trainer.run`` runs per iteration, minus the data pipeline.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_section(name: str, vocab: int, **overrides) -> dict:
    """hydra_conf/model/<name>.yaml (the shape the experiments use) with the vocabulary and overrides."""
    with open(os.path.join(REPO, "hydra_conf", "model", f"{name}.yaml"), encoding="utf-8") as f:
        return {**yaml.safe_load(f), "vocab_size": vocab, **overrides}


@dataclass(frozen=True)
class StepSpec:
    """One configuration of the step: the knobs the A/B rows of bench/gpu_check.sh turn."""

    model: str = "codeparrot_small"
    vocab: int = 32768
    micro_batch: int = 8
    precision: str = "bf16"
    recipe: str = "autocast"
    kernels: str = "csrc"
    sdpa_backend: str = "auto"
    attention_dropout: float | None = None  # None: the model file's
    kernel_check: str = "off"  # timing runs skip the start-up check (its cost: bench/kernel_check.py)
    extra: dict = field(default_factory=dict)  # further model.* overrides

    def label(self) -> str:
        drop = "" if self.attention_dropout is None else f" attn-drop {self.attention_dropout:g}"
        return (f"{self.model} mb{self.micro_batch} {self.precision} {self.recipe} {self.kernels} "
                f"sdpa={self.sdpa_backend}{drop}")

    def config(self, device: str):
        from trainer.config import RunConfig

        model = model_section(self.model, self.vocab, sdpa_backend=self.sdpa_backend, **self.extra)
        if self.attention_dropout is not None:
            model["attention_dropout"] = self.attention_dropout
        return RunConfig.from_dict({
            "model": model, "kernels": self.kernels, "run_dir": "/tmp/slipway-bench-step",
            "train": {"micro_batch_size": self.micro_batch, "global_batch_size": self.micro_batch,
                      "iters": 10**6, "precision": self.precision, "precision_recipe": self.recipe,
                      "device": device, "kernel_check": self.kernel_check},
            "optim": {"lr": 1e-4, "weight_decay": 0.1, "clip_grad": 1.0}})


@dataclass
class Stepper:
    """A built model with its optimizer; ``step()`` queues one training step and returns its loss tensor."""

    spec: StepSpec
    device: torch.device
    loop: object
    seq: int
    vocab: int

    def batch(self) -> list[dict]:
        from trainer.run.host import to_device

        t = torch.randint(0, self.vocab, (self.spec.micro_batch, self.seq + 1))
        return [to_device({"tokens": t[:, :-1], "labels": t[:, 1:]}, self.device)]

    def step(self) -> torch.Tensor:
        from trainer.run.loop import step

        return step(self.loop, self.batch()).loss_t

    def flops_per_step(self) -> float:
        from trainer.formulas import model_flops_per_iteration

        gpt = self.loop.model.chunks[0].cfg
        return model_flops_per_iteration(gpt, self.spec.micro_batch, gpt.padded_vocab_size(1))


def build(spec: StepSpec, device: torch.device) -> Stepper:
    from trainer.parallel import ParallelState
    from trainer.run.entry import build_components
    from trainer.run.loop import Loop

    cfg = spec.config(device.type)
    c = build_components(cfg, ParallelState.single(device))
    loop = Loop(model=c.model, optimizer=c.parts.optimizer, scheduler=c.parts.scheduler,
                scaler=c.parts.scaler, precision=spec.precision, clip_grad=cfg.optim.clip_grad,
                global_batch_size=spec.micro_batch, num_microbatches=1, train_iters=10**6, train_data=None,
                valid_data=None, save=lambda s: None, wandb=None, cadence=None, throughput=None)
    return Stepper(spec, device, loop, c.gpt.seq_length, spec.vocab)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
