"""kernels=compile_layer: each transformer layer compiled whole (torch.compile of the reference ops) gives
the eager model's loss and gradients, its layers share one graph, and the start-up check passes it and
catches a wrong one. Inductor on CPU compiles in about 15 s per distinct graph here: marked slow (budget
about 60 s on CI's two cores)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import trainer.model.gpt as gpt_module
from trainer import extension as _ext
from trainer.config import RunConfig
from trainer.config.model import ModelConfig
from trainer.model.gpt import build_gpt, masked_mean
from trainer.parallel import ParallelState
from trainer.run.kernels import checked_kernels
from trainer.run.layer_check import check_compiled_layer

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not _ext.load(), reason="needs trainer._C")]

CFG = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=200,
                  hidden_dropout=0.0, attention_dropout=0.0)


def _loss_and_grads(kernels: str, tokens: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    model = build_gpt(CFG, seed=3, kernels=kernels).train()
    loss = masked_mean(model(tokens, labels=torch.roll(tokens, -1, 1)))
    loss.backward()
    return float(loss), [p.grad for p in model.parameters()]


def test_compiled_layers_match_the_per_op_model_and_share_one_graph():
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_length), generator=torch.Generator().manual_seed(0))
    want, want_grads = _loss_and_grads("csrc", tokens)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got, grads = _loss_and_grads("compile_layer", tokens)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 1  # two layers, one graph
    assert got == pytest.approx(want, rel=1e-6)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_layer_check_passes_the_compiled_layer_and_catches_a_wrong_one(monkeypatch):
    ok = check_compiled_layer(CFG, torch.device("cpu"), torch.bfloat16, torch.float32)  # autocast recipe
    assert ok.ok and 0 < ok.max_error < ok.tolerance, ok

    def miscompiled():  # what a compiler bug looks like: slightly wrong outputs
        return lambda layer, x: layer.block(x) * 1.05

    monkeypatch.setattr(gpt_module, "compiled_layer", miscompiled)
    bad = check_compiled_layer(CFG, torch.device("cpu"), torch.bfloat16, torch.float32)
    assert not bad.ok and bad.op == "transformer_layer", bad
    cfg = RunConfig.from_dict({"model": {**{k: getattr(CFG, k) for k in ("num_layers", "hidden_size",
                                                                        "num_attention_heads", "seq_length",
                                                                        "vocab_size")}},
                               "train": {"precision": "bf16", "device": "cpu", "kernel_check": "fallback"},
                               "kernels": "compile_layer", "run_dir": "/nonexistent/compile-layer"})
    check = checked_kernels(cfg, cfg.model, ParallelState.single())
    assert check.kernels.compile_layers is False and "transformer_layer" in check.fallbacks


def test_selective_recompute_is_refused_with_compiled_layers():
    with pytest.raises(ValueError, match="recompute_granularity"):
        RunConfig.from_dict({"kernels": "compile_layer", "train": {"recompute_granularity": "selective"}})
