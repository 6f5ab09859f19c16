"""The FLOPs and parameter formulas (trainer.formulas) against the real model, for every architecture
option (GQA/MQA, SwiGLU, no biases, RMSNorm, rope, an untied head, a non-4h MLP).

FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` counts every matmul of one real forward + backward
(2·m·n·k each); Megatron's ``num_floating_point_operations`` counts the same GEMMs, so the two must be
equal. Parameters: the single-device model's ``numel``, Hugging Face's own ``num_parameters`` (the
published Llama-3.2-1B count), and each rank of a real tp=2 × pp=2 ParallelModel on gloo.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.parallel import harness as H
from trainer import formulas
from trainer.config.model import ModelConfig
from trainer.parallel import ParallelConfig, ParallelState, build_model
from trainer.parallel import engine as E

REPO = Path(__file__).resolve().parents[2]
VOCAB = 1024  # a multiple of 128·tp for tp ≤ 8: the padding is the same at every layout here


def preset(name: str, **changes) -> ModelConfig:
    d = yaml.safe_load((REPO / "hydra_conf" / "model" / f"{name}.yaml").read_text())
    return ModelConfig(**{**d, "vocab_size": VOCAB, **changes})


CASES = {
    "gpt_tiny": preset("gpt_tiny"),
    "gpt_ffn3h": preset("gpt_tiny", ffn_hidden_size=384),
    "llama_tiny": preset("llama_tiny"),  # GQA 2 groups / 4 heads, SwiGLU, RMSNorm, rope, no bias, untied
    "llama_mqa_tied": preset("llama_tiny", num_query_groups=1, tie_word_embeddings=True),
    "llama_bias_layernorm": preset("llama_tiny", add_bias_linear=True, normalization="layernorm"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_flops_equal_the_matmuls_of_a_real_step(name):
    from torch.utils.flop_counter import FlopCounterMode

    cfg = dataclasses.replace(CASES[name], attention_backend="softmax")  # explicit bmm: every GEMM counted
    model = build_model(cfg, ParallelConfig(), ParallelState.single(), 1234, kernels="eager")
    b, s = 2, cfg.seq_length
    tokens = torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(b, s),
             "position_ids": torch.arange(s).expand(b, s)}
    with FlopCounterMode(display=False) as counter:
        E.train_step(model, [batch])
    assert counter.get_total_flops() == formulas.model_flops_per_iteration(cfg, b, cfg.padded_vocab_size(1))


def test_default_arguments_are_narayanans_gpt_formula():
    b, s, l, h, v = 192, 1024, 12, 768, 32768
    assert formulas.flops_per_iteration(b, s, l, h, v, num_attention_heads=12) == pytest.approx(
        72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h)), rel=1e-12)


@pytest.mark.parametrize("name", sorted(CASES))
def test_total_parameters_equal_the_models(name):
    cfg = CASES[name]
    model = build_model(cfg, ParallelConfig(), ParallelState.single(), 1234, kernels="eager")
    real = sum(p.numel() for p in model.parameters())
    assert formulas.stage_params(cfg, cfg.padded_vocab_size(1)) == (real, real)


def test_llama_1b_preset_has_llama_3_2_1b_parameter_count():
    """Hugging Face's LlamaForCausalLM of the preset's shape (built on the meta device) and the published
    1,235,814,400 of meta-llama/Llama-3.2-1B (vocabulary 128,256, already a multiple of 128)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = preset("llama_1b", vocab_size=128256)
    hf = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True)
    with torch.device("meta"):
        count = LlamaForCausalLM(hf).num_parameters()
    assert count == 1_235_814_400
    assert formulas.stage_params(cfg, cfg.padded_vocab_size(1))[1] == count


def _count_job(ranks: list[int], name: str, outdir: str) -> None:
    pstate = ParallelState.build(2, 2, ranks)
    model = build_model(CASES[name], ParallelConfig(tp_size=2, pp_size=2), pstate, 1234, kernels="eager")
    n = sum(p.numel() for p in model.parameters())
    Path(outdir, f"{name}.{H.position(ranks)}.json").write_text(json.dumps(n))
    pstate.destroy()


@pytest.mark.slow
def test_busiest_stage_parameters_equal_a_real_tp2_pp2_rank(tmp_path):
    names = [n for n in sorted(CASES) if not CASES[n].tp_issues(2)]  # MQA's one KV group cannot split
    assert len(names) == len(CASES) - 1
    H.run_rounds(4, [[([0, 1, 2, 3], _count_job, (name, str(tmp_path)))] for name in names], tmp_path)
    for name in names:
        per_rank = [json.loads(p.read_text()) for p in sorted(tmp_path.glob(f"{name}.*.json"))]
        assert len(per_rank) == 4
        cfg = CASES[name]
        busiest = formulas.stage_params(cfg, cfg.padded_vocab_size(2), 2, 2)[0]
        assert busiest == max(per_rank), (name, per_rank)


def test_plan_memory_uses_the_architecture():
    """The plan's parameter count of the 1B Llama preset is the formula's (GQA, SwiGLU, no biases)."""
    from orchestrator.base.estimate import stage_params
    from tests.orchestrator.conftest import compose_cfg

    cfg = compose_cfg(["model=llama_1b", "parallel.tp_size=1", "parallel.pp_size=1"])
    assert stage_params(cfg, 128256)[1] == 1_235_814_400
