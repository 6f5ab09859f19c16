"""checkpoint.load compares the architecture, not only the shape: a GPT-2 and a Llama layer of one size
have the same parameter shapes (without biases, even the same names), so a mismatch would load silently
and compute something else. Megatron-LM's own args (num_query_groups=1 without --group-query-attention,
an int rotary base) must still match the model they describe."""

from __future__ import annotations

import argparse

import pytest

from trainer.checkpoint.files import CheckpointError
from trainer.config.model import ModelConfig
from trainer.run.entry import _check_model

LLAMA = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
             seq_length=64, vocab_size=1024, position_embedding="rope", rotary_base=500000.0,
             normalization="rmsnorm", activation="swiglu", add_bias_linear=False, tie_word_embeddings=False)
GPT2 = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=64,
            vocab_size=1024)


def _model(**fields) -> ModelConfig:
    cfg = ModelConfig(**fields)
    cfg._normalise()
    return cfg


def _megatron_args(llama: bool, **extra) -> argparse.Namespace:
    """What Megatron-LM writes for the two families (its defaults where a flag is not given)."""
    common = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64,
                  max_position_embeddings=64, norm_epsilon=1e-5, rotary_base=10000, rotary_percent=1.0)
    if llama:
        family = dict(ffn_hidden_size=128, position_embedding_type="rope", normalization="RMSNorm",
                      swiglu=True, group_query_attention=True, num_query_groups=2, add_bias_linear=False,
                      untie_embeddings_and_output_weights=True, rotary_base=500000)
    else:
        family = dict(ffn_hidden_size=256, position_embedding_type="learned_absolute",
                      normalization="LayerNorm", swiglu=False, group_query_attention=False,
                      num_query_groups=1, add_bias_linear=True, untie_embeddings_and_output_weights=False)
    return argparse.Namespace(**{**common, **family, **extra})


def test_megatron_lm_args_of_the_configured_family_load():
    _check_model(_megatron_args(llama=False), _model(**GPT2), "ck", 7)
    _check_model(_megatron_args(llama=True), _model(**LLAMA), "ck", 7)


@pytest.mark.parametrize("saved, configured, field", [
    (dict(llama=True, ffn_hidden_size=256), GPT2, "position_embedding_type"),  # Llama weights, GPT-2 model
    (dict(llama=True, rotary_base=10000), LLAMA, "rotary_base"),
    (dict(llama=True, num_query_groups=4), LLAMA, "num_query_groups"),
    (dict(llama=True, norm_epsilon=1e-6), LLAMA, "norm_epsilon"),
    (dict(llama=True, untie_embeddings_and_output_weights=False), LLAMA,
     "untie_embeddings_and_output_weights"),
])
def test_another_architecture_is_refused_with_the_field_named(saved, configured, field):
    with pytest.raises(CheckpointError, match=f"different model .*'{field}'"):
        _check_model(_megatron_args(**saved), _model(**configured), "ck", 7)


# What megatron-core cannot build on CPU (tests/mcore/test_llama.py builds the others): fp8 and
# apply_layernorm_1p need Transformer Engine or apex, the post-LN residual only the legacy model has.
@pytest.mark.parametrize("option, value, flag", [
    ("rotary_interleaved", True, "--rotary-interleaved"), ("fp8", "hybrid", "--fp8-format"),
    ("apply_layernorm_1p", True, "--apply-layernorm-1p"),
    ("apply_residual_connection_post_layernorm", True, "--apply-residual-connection-post-layernorm"),
])
def test_an_option_slipways_gpt_lacks_is_refused_before_the_shape(option, value, flag):
    args = _megatron_args(llama=True, hidden_size=128, **{option: value})  # the shape differs too
    with pytest.raises(CheckpointError, match=f"cannot be loaded: .*{option}=.*fix: .*{flag}"):
        _check_model(args, _model(**LLAMA), "ck", 7)
