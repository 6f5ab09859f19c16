"""The Llama-family options of the one GPT (issue 16): HF LlamaForCausalLM parity, grouped-query attention,
the options' parameters, their config rules, and the presets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from trainer.config.model import ModelConfig
from trainer.config_issues import ConfigError
from trainer.model import GPT, build_gpt

LLAMA = dict(num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=24,
             vocab_size=100, hidden_dropout=0.0, attention_dropout=0.0, position_embedding="rope",
             rotary_base=500000.0, normalization="rmsnorm", norm_epsilon=1e-6, activation="swiglu",
             ffn_hidden_size=96, add_bias_linear=False, tie_word_embeddings=False)
PRESETS = Path(__file__).resolve().parents[2] / "hydra_conf" / "model"


def to_llama_state_dict(model: GPT) -> dict:
    """Megatron names → HF LlamaForCausalLM, written here independently of trainer.convert."""
    cfg, sd = model.cfg, {k: v.detach() for k, v in model.state_dict().items()}
    n, g, d, h, v = cfg.num_attention_heads, cfg.query_groups, cfg.head_dim, cfg.hidden_size, cfg.vocab_size
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"][:v],
           "model.norm.weight": sd["encoder.final_layernorm.weight"],
           "lm_head.weight": sd["output_layer.weight"][:v]}
    for i in range(cfg.num_layers):
        p, q = f"encoder.layers.{i}.", f"model.layers.{i}."
        qkv = sd[p + "self_attention.query_key_value.weight"].view(g, n // g + 2, d, h)  # per KV group
        out[q + "self_attn.q_proj.weight"] = qkv[:, : n // g].reshape(n * d, h)
        out[q + "self_attn.k_proj.weight"] = qkv[:, n // g].reshape(g * d, h)
        out[q + "self_attn.v_proj.weight"] = qkv[:, n // g + 1].reshape(g * d, h)
        out[q + "self_attn.o_proj.weight"] = sd[p + "self_attention.dense.weight"]
        gate, up = sd[p + "mlp.dense_h_to_4h.weight"].chunk(2)
        out[q + "mlp.gate_proj.weight"], out[q + "mlp.up_proj.weight"] = gate, up
        out[q + "mlp.down_proj.weight"] = sd[p + "mlp.dense_4h_to_h.weight"]
        out[q + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
        out[q + "post_attention_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"]
    return out


def _hf_llama(cfg: ModelConfig):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.query_groups,
                         max_position_embeddings=cfg.seq_length, rms_norm_eps=cfg.norm_epsilon,
                         rope_theta=cfg.rotary_base, tie_word_embeddings=False, attention_bias=False,
                         mlp_bias=False)
    return LlamaForCausalLM(hf_cfg).eval()


@pytest.mark.parametrize("groups", [2, 1, 4], ids=["gqa", "mqa", "mha"])
def test_llama_options_match_hf_llama(groups):
    cfg = ModelConfig(**{**LLAMA, "num_query_groups": groups})
    model = build_gpt(cfg, seed=3, kernels="eager").eval()
    with torch.no_grad():  # non-trivial norm weights, so a swapped norm would show
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    hf = _hf_llama(cfg)
    missing, unexpected = hf.load_state_dict(to_llama_state_dict(model), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens=tokens)[..., : cfg.vocab_size]
        theirs = hf(tokens).logits
    assert (ours - theirs).abs().max().item() < 1e-5


def test_grouped_query_attention_is_mha_with_each_groups_kv_repeated():
    """GQA's [ng, (np/ng) q + k + v, d] rows: repeating each group's k and v for its heads gives an MHA
    model with the same logits (query head j uses KV group j // (np/ng))."""
    gqa = build_gpt(ModelConfig(**LLAMA), seed=5, kernels="eager").eval()
    mha = build_gpt(ModelConfig(**{**LLAMA, "num_query_groups": 4}), seed=5, kernels="eager").eval()
    n, g, d, h = 4, 2, 16, 64
    sd = gqa.state_dict()
    for i in range(LLAMA["num_layers"]):
        key = f"encoder.layers.{i}.self_attention.query_key_value.weight"
        rows = sd[key].view(g, n // g + 2, d, h)
        per_head = [torch.stack([rows[j // (n // g), j % (n // g)], rows[j // (n // g), -2],
                                 rows[j // (n // g), -1]]) for j in range(n)]  # MHA: per head [q, k, v]
        sd[key] = torch.stack(per_head).reshape(3 * n * d, h)
    mha.load_state_dict(sd)
    tokens = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(gqa(tokens=tokens), mha(tokens=tokens), rtol=1e-5, atol=1e-5)


def test_options_shape_the_parameters():
    names = {n: tuple(p.shape) for n, p in GPT(ModelConfig(**LLAMA), kernels="eager").named_parameters()}
    assert names["encoder.layers.0.self_attention.query_key_value.weight"] == ((4 + 2 * 2) * 16, 64)
    assert names["encoder.layers.0.mlp.dense_h_to_4h.weight"] == (2 * 96, 64)  # [gate; up]
    assert names["output_layer.weight"] == (128, 64)
    assert not [n for n in names if n.endswith(".bias")]  # RMSNorm and add_bias_linear=false
    assert "embedding.position_embeddings.weight" not in names  # rope: no table
    tied = GPT(ModelConfig(**{**LLAMA, "tie_word_embeddings": True}), kernels="eager")
    assert not hasattr(tied, "output_layer") and tied.head_weight() is tied.embedding.word_embeddings.weight


def test_defaults_are_gpt2_and_the_megatron_names_of_the_options():
    cfg = ModelConfig(vocab_size=100)
    assert (cfg.position_embedding, cfg.normalization, cfg.activation) == ("learned", "layernorm", "gelu")
    assert cfg.query_groups == cfg.num_attention_heads and cfg.add_bias_linear and cfg.tie_word_embeddings
    assert cfg.megatron_architecture() == {
        "position_embedding_type": "learned_absolute", "rotary_base": 10000.0, "rotary_percent": 1.0,
        "normalization": "LayerNorm", "norm_epsilon": 1e-5, "swiglu": False, "add_bias_linear": True,
        "group_query_attention": False, "num_query_groups": 12, "untie_embeddings_and_output_weights": False}
    llama = ModelConfig(**LLAMA).megatron_architecture()
    assert llama["position_embedding_type"] == "rope" and llama["normalization"] == "RMSNorm"
    assert llama["swiglu"] and llama["group_query_attention"] and llama["untie_embeddings_and_output_weights"]
    # Megatron's --swiglu default width: int(4h·2/3 / 64)·64.
    assert ModelConfig(hidden_size=2048, num_attention_heads=16, activation="swiglu").ffn_hidden_size == 5440


def test_config_refuses_what_cannot_be_built():
    with pytest.raises(ConfigError, match="num_query_groups=3.*does not divide"):
        ModelConfig(**{**LLAMA, "num_query_groups": 3})
    with pytest.raises(ConfigError, match="model.activation"):
        ModelConfig(**{**LLAMA, "activation": "geglu"})
    with pytest.raises(ConfigError, match="rotary_percent"):
        ModelConfig(**{**LLAMA, "rotary_percent": 0.1})  # 1.6 of 16 dims
    issues = ModelConfig(**LLAMA).tp_issues(4)
    assert [i.code for i in issues] == ["tp_num_query_groups"] and "num_query_groups=2" in str(issues[0])


def test_partial_rotary_leaves_the_other_dims_alone():
    """rotary_percent=0.5 rotates the first half of each head's dims: a model with it differs from full
    rope, and both differ from no positions at all."""
    tokens = torch.randint(0, 100, (1, 24), generator=torch.Generator().manual_seed(2))
    outs = []
    for percent in (1.0, 0.5):
        model = build_gpt(ModelConfig(**{**LLAMA, "rotary_percent": percent}), seed=1, kernels="eager").eval()
        assert model.encoder.layers[0].self_attention.rotary.rotary_dim == int(16 * percent)
        with torch.no_grad():
            outs.append(model(tokens=tokens))
    assert not torch.allclose(outs[0], outs[1])


@pytest.mark.parametrize("preset,params", [("llama_tiny", None), ("llama_1b", 1_235_814_400)])
def test_presets_build(preset, params):
    values = yaml.safe_load((PRESETS / f"{preset}.yaml").read_text())
    cfg = ModelConfig(**values, vocab_size=128256 if params else 1000)
    with torch.device("meta"):
        model = GPT(cfg, kernels="eager")
    assert cfg.position_embedding == "rope" and cfg.query_groups < cfg.num_attention_heads
    if params:  # Llama-3.2-1B's parameter count (its model card: 1.24B; tied head)
        assert sum(p.numel() for p in model.parameters()) == params
