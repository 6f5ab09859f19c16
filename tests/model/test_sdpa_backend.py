"""model.sdpa_backend: the SDPA kernel follows the config, the start of a job names it, and a named kernel
that cannot run the model fails at start-up with the key in the message (CPU: torch's flash kernel
without dropout, math with it; cuDNN does not exist there). The CUDA ranking is exercised by
bench/gpu_check.sh (attention rows)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.logs import captured
from trainer import extension as _ext
from trainer.config import RunConfig
from trainer.config.model import ModelConfig
from trainer.model.attention import CUDA_PRIORITY, describe
from trainer.model.gpt import build_gpt, masked_mean
from trainer.parallel import ParallelState
from trainer.run.entry import build_components

CPU = torch.device("cpu")


def _cfg(**kw) -> ModelConfig:
    return ModelConfig(**{"num_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
                          "vocab_size": 100, **kw})


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _attention_ops(**kw) -> set[str]:
    model = build_gpt(_cfg(**kw), seed=0, kernels="eager").train()
    tokens = torch.randint(0, 100, (2, 16))
    with Ops() as ops:
        masked_mean(model(tokens, labels=tokens)).backward()
    return {n for n in ops.names if "attention" in n or n in ("bmm", "_softmax")}


def test_the_configured_kernel_is_the_one_that_runs():
    assert "_scaled_dot_product_flash_attention_for_cpu" in _attention_ops(attention_dropout=0.0)
    forced = _attention_ops(attention_dropout=0.0, sdpa_backend="math")
    assert "_scaled_dot_product_flash_attention_for_cpu" not in forced and "bmm" in forced
    assert "_scaled_dot_product_flash_attention_for_cpu" not in _attention_ops(attention_dropout=0.1)


def test_the_start_up_line_names_training_and_evaluation_kernels():
    assert describe(_cfg(attention_dropout=0.1), CPU, torch.bfloat16, 4).endswith(
        "training (dropout 0.1) runs math, evaluation runs flash")
    assert describe(_cfg(attention_dropout=0.0), CPU, torch.float32, 4).endswith(
        "training (no dropout) runs flash, evaluation runs flash")
    assert "explicit softmax" in describe(_cfg(attention_backend="softmax"), CPU, torch.float32, 4)
    assert CUDA_PRIORITY[0] == torch.nn.attention.SDPBackend.CUDNN_ATTENTION  # cuDNN first where it can


def test_a_kernel_that_cannot_run_fails_at_start_up_naming_the_key():
    with pytest.raises(ValueError, match="model.sdpa_backend=cudnn cannot run"):
        describe(_cfg(sdpa_backend="cudnn"), CPU, torch.float32, 4)
    with pytest.raises(ValueError, match="sdpa_backend"):
        ModelConfig(vocab_size=100, sdpa_backend="fa3")


@pytest.mark.skipif(not _ext.load(), reason="needs trainer._C")
def test_the_job_logs_the_attention_kernel():
    cfg = RunConfig.from_dict({"model": {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 4,
                                         "seq_length": 16, "vocab_size": 100},
                               "train": {"device": "cpu", "kernel_check": "off", "precision": "bf16"},
                               "run_dir": "/nonexistent/sdpa"})
    with captured() as lines:
        build_components(cfg, ParallelState.single())
    assert any(m.startswith("attention: SDPA, model.sdpa_backend=auto on cpu bfloat16") for m in lines), lines
    assert any(m.startswith("precision: bf16 autocast (auto)") for m in lines), lines
