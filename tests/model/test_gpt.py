"""The single-device GPT: HF GPT-2 parity, stage split, init rules, Megatron names, import isolation."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from trainer.config.model import ModelConfig
from trainer.formulas import padded_vocab_size
from trainer.model import (
    GPT,
    StageSpec,
    build_gpt,
    init_weights,
    load_megatron_state_dict,
    masked_mean,
    megatron_state_dict,
)

TINY = dict(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100,
            hidden_dropout=0.0, attention_dropout=0.0)


def to_hf_state_dict(model: GPT) -> dict:
    """Megatron names → HF GPT2LMHeadModel (formats.md §5), written here independently of trainer.convert."""
    cfg, sd = model.cfg, {k: v.detach() for k, v in model.state_dict().items()}
    n, d, h = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
    out = {"transformer.wte.weight": sd["embedding.word_embeddings.weight"][: cfg.vocab_size],
           "transformer.wpe.weight": sd["embedding.position_embeddings.weight"],
           "transformer.ln_f.weight": sd["encoder.final_layernorm.weight"],
           "transformer.ln_f.bias": sd["encoder.final_layernorm.bias"]}
    for i in range(cfg.num_layers):
        p, q = f"encoder.layers.{i}.", f"transformer.h.{i}."
        # Per-head [q, k, v] rows → [Q of all heads, K, V], then Conv1D's [in, out].
        qkv_w = sd[p + "self_attention.query_key_value.weight"].view(n, 3, d, h).transpose(0, 1)
        qkv_w = qkv_w.reshape(3 * h, h)
        qkv_b = sd[p + "self_attention.query_key_value.bias"].view(n, 3, d).transpose(0, 1).reshape(3 * h)
        out |= {q + "ln_1.weight": sd[p + "input_layernorm.weight"],
                q + "ln_1.bias": sd[p + "input_layernorm.bias"],
                q + "ln_2.weight": sd[p + "post_attention_layernorm.weight"],
                q + "ln_2.bias": sd[p + "post_attention_layernorm.bias"],
                q + "attn.c_attn.weight": qkv_w.t(), q + "attn.c_attn.bias": qkv_b,
                q + "attn.c_proj.weight": sd[p + "self_attention.dense.weight"].t(),
                q + "attn.c_proj.bias": sd[p + "self_attention.dense.bias"],
                q + "mlp.c_fc.weight": sd[p + "mlp.dense_h_to_4h.weight"].t(),
                q + "mlp.c_fc.bias": sd[p + "mlp.dense_h_to_4h.bias"],
                q + "mlp.c_proj.weight": sd[p + "mlp.dense_4h_to_h.weight"].t(),
                q + "mlp.c_proj.bias": sd[p + "mlp.dense_4h_to_h.bias"]}
    return out


@pytest.mark.parametrize("backend", ["sdpa", "softmax"])
def test_logits_and_loss_match_hf_gpt2(backend):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = ModelConfig(**TINY, attention_backend=backend)
    model = build_gpt(cfg, seed=3).eval()
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.max_position_embeddings,
                                    n_embd=cfg.hidden_size, n_layer=cfg.num_layers,
                                    n_head=cfg.num_attention_heads,
                                    activation_function="gelu_new", layer_norm_epsilon=1e-5,
                                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)).eval()
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(model), strict=False)
    assert [k for k in missing if k != "lm_head.weight"] == [] and unexpected == []
    tokens = torch.randint(0, cfg.vocab_size, (3, cfg.seq_length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens=tokens)[..., : cfg.vocab_size]
        theirs = hf(tokens, labels=tokens)
        loss = masked_mean(model(tokens=tokens[:, :-1], labels=tokens[:, 1:]))
    torch.testing.assert_close(ours, theirs.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, theirs.loss, rtol=1e-5, atol=1e-6)


def test_padded_vocab_is_zero_and_out_of_the_loss():
    cfg = ModelConfig(**TINY)
    model = build_gpt(cfg, seed=0)
    emb = model.embedding.word_embeddings.weight
    assert emb.shape[0] == 128 and emb[100:].abs().max() == 0
    tokens = torch.randint(0, 100, (2, 16))
    losses = model(tokens=tokens, labels=tokens)
    ref = F.cross_entropy(model(tokens=tokens)[..., :100].flatten(0, 1), tokens.flatten(), reduction="none")
    torch.testing.assert_close(losses.flatten(), ref)
    masked_mean(losses).backward()
    assert emb.grad[100:].abs().max() == 0


def test_init_rules():
    cfg = ModelConfig(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=1000)
    model = build_gpt(cfg, seed=0)
    params = dict(model.named_parameters())
    qkv = params["encoder.layers.3.self_attention.query_key_value.weight"]
    dense = params["encoder.layers.3.self_attention.dense.weight"]
    assert abs(qkv.std().item() - 0.02) < 0.002 and abs(qkv.mean().item()) < 0.002
    assert abs(dense.std().item() - 0.02 / 4.0) < 0.001  # 0.02 / sqrt(2·8)
    assert abs(params["encoder.layers.0.mlp.dense_4h_to_h.weight"].std().item() - 0.005) < 0.0005
    assert torch.all(params["encoder.layers.0.input_layernorm.weight"] == 1)
    assert torch.all(params["encoder.layers.0.mlp.dense_h_to_4h.bias"] == 0)
    # Distinct parameters get distinct draws; the same seed gives the same weights.
    assert not torch.equal(params["encoder.layers.0.mlp.dense_h_to_4h.weight"],
                           params["encoder.layers.1.mlp.dense_h_to_4h.weight"])
    again = build_gpt(cfg, seed=0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))


def test_pipeline_stages_compose_to_the_whole_model():
    cfg = ModelConfig(**TINY)
    whole = build_gpt(cfg, seed=5)
    first, last = GPT(cfg, StageSpec(0, 1, True, False)), GPT(cfg, StageSpec(1, 4, False, True))
    init_weights(first, 5), init_weights(last, 5)
    whole_params = dict(whole.named_parameters())
    for stage in (first, last):
        for name, p in stage.named_parameters():
            ref_name = "embedding.word_embeddings.weight" if name.startswith("word_embeddings_for_head") \
                else stage.global_name(name)
            assert torch.equal(p, whole_params[ref_name]), name
    tokens = torch.randint(0, 100, (2, 16))
    torch.testing.assert_close(last(hidden=first(tokens=tokens), labels=tokens),
                               whole(tokens=tokens, labels=tokens))


def test_megatron_layout_roundtrip():
    cfg = ModelConfig(**TINY)
    stage = GPT(cfg, StageSpec(2, 4, False, True))
    init_weights(stage, 1)
    nested = megatron_state_dict(stage)
    assert set(nested) == {"language_model", "word_embeddings_for_head"}
    enc = nested["language_model"]["encoder"]
    assert "layers.0.self_attention.query_key_value.weight" in enc  # local layer indices
    assert "layers.2.mlp.dense_h_to_4h.bias" not in enc
    assert enc["layers.1.self_attention.query_key_value.weight"].shape == (96, 32)
    assert "final_layernorm.weight" in enc and nested["word_embeddings_for_head"]["weight"].shape == (128, 32)
    fresh = GPT(cfg, StageSpec(2, 4, False, True))
    load_megatron_state_dict(fresh, {k: v for k, v in nested.items()})
    assert all(torch.equal(p, q) for p, q in zip(stage.parameters(), fresh.parameters()))
    whole = build_gpt(cfg, seed=1)
    embedding = megatron_state_dict(whole)["language_model"]["embedding"]
    assert set(embedding) == {"word_embeddings", "position_embeddings"}
    with pytest.raises(KeyError, match="missing"):
        load_megatron_state_dict(whole, nested)


def test_config_validation_and_padding():
    assert padded_vocab_size(32768) == 32768 and padded_vocab_size(50257) == 50304
    assert padded_vocab_size(100, tp_size=2) == 256
    with pytest.raises(ValueError, match="num_attention_heads"):
        ModelConfig(num_layers=1, hidden_size=30, num_attention_heads=4, seq_length=8, vocab_size=10)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=10,
                  max_position_embeddings=4)
    with pytest.raises(ValueError, match="kernels"):
        GPT(ModelConfig(**TINY), kernels="nope")


def test_model_imports_neither_distributed_nor_parallel():
    # `import torch` itself loads torch.distributed, so sys.modules cannot show what trainer.model uses:
    # check the source statically, and at runtime that trainer.parallel is not pulled in.
    import ast
    from pathlib import Path

    import trainer.model

    for path in Path(trainer.model.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            bad = [n for n in names if n.startswith(("torch.distributed", "trainer.parallel"))]
            assert not bad, f"{path.name}:{node.lineno} imports {bad}"
        assert "dist." not in path.read_text().replace("_dist.", ""), path
    code = ("import sys, trainer.model; from trainer.model import build_gpt\n"
            "from trainer.config.model import ModelConfig\n"
            "build_gpt(ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, seq_length=4, "
            "vocab_size=9), 0)\n"
            "print(sorted(m for m in sys.modules if m.startswith('trainer.parallel')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
