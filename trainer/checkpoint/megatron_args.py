"""A checkpoint's ``args``: an ``argparse.Namespace`` of plain values with Megatron-LM's names
(formats.md §4).

Megatron-LM's loader and the transformers conversion script read ``args`` by attribute, so a dict there
fails both (``'dict' object has no attribute 'num_layers'``). :data:`READER_ARGS` is what they read;
:func:`megatron_args` builds the Namespace that the trainer (``trainer.restore.state``) and the Hugging Face
importer (``trainer.convert.from_hf``) both write, so the two never disagree on a name or a default.

Values are plain (bool, int, float, str, list, None): the file loads with ``torch.load(weights_only=True)``
once ``argparse.Namespace`` is allowed (``torch.serialization.safe_globals``), and without Megatron.
Torch-free: the orchestrator may import it.
"""

from __future__ import annotations

import argparse
from typing import Any

# Every attribute an outside reader takes from ``args``; a checkpoint must carry all of them.
READER_ARGS = (
    # Megatron-LM core_v0.8.0 megatron/training/checkpointing.py, check_checkpoint_args (_compare: asserts
    # equality with the run's own args; tokenizer_type, max_position_embeddings, make_vocab_size_divisible_by
    # and padded_vocab_size only when the run has --vocab-file, data_parallel_random_init only when set).
    "num_layers", "hidden_size", "num_attention_heads", "add_position_embedding", "max_position_embeddings",
    "make_vocab_size_divisible_by", "padded_vocab_size", "tokenizer_type", "tensor_model_parallel_size",
    "pipeline_model_parallel_size", "data_parallel_random_init",
    # Same file, load_checkpoint: getattr(checkpoint_args, ..., 0) sets the resumed sample counters.
    "consumed_train_samples", "consumed_valid_samples",
    # Same file, load_args_from_checkpoint (--use-checkpoint-args, tools/checkpoint/loader_megatron.py):
    # _set_arg copies each one that is not None into the run's args (most with force=True).
    "ffn_hidden_size", "seq_length", "num_query_groups", "group_query_attention", "kv_channels",
    "position_embedding_type", "use_rotary_position_embeddings", "rotary_percent", "rotary_interleaved",
    "add_bias_linear", "add_qkv_bias", "swiglu", "untie_embeddings_and_output_weights", "apply_layernorm_1p",
    "normalization", "apply_query_key_layer_scaling", "virtual_pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage",
    # core_v0.8.0 tools/checkpoint/loader_megatron.py: checkpoint_args.fp16 / .bf16 (plain attribute access).
    "fp16", "bf16",
    # transformers v4.27 models/megatron_gpt2/convert_megatron_gpt2_checkpoint.py, ds_args.*: the config
    # (padded_vocab_size, max_position_embeddings, hidden_size, num_layers, num_attention_heads — above —
    # and ffn_hidden_size), the activation (bias_gelu_fusion → gelu_fast, else openai_gelu → gelu_new,
    # else gelu) and the tokenizer (tokenizer_type, above: GPT2BPETokenizer or PretrainedFromHF).
    "bias_gelu_fusion", "openai_gelu",
)

# Megatron's values for what Slipway's GPT always is (GPT-2: learned positions, LayerNorm, tanh GeLU, tied
# head, biases, no GQA/MoE/rotary); a caller overrides only what it really knows otherwise.
_GPT2_ARCHITECTURE: dict[str, Any] = {
    "add_position_embedding": True, "position_embedding_type": "learned_absolute",
    "use_rotary_position_embeddings": False, "rotary_percent": 1.0, "rotary_interleaved": False,
    "normalization": "LayerNorm", "apply_layernorm_1p": False, "add_bias_linear": True, "add_qkv_bias": False,
    "swiglu": False, "group_query_attention": False, "num_experts": None,
    "untie_embeddings_and_output_weights": False, "apply_residual_connection_post_layernorm": False,
    # Scaling by the layer number and back is the identity in fp32 softmax; Megatron ≥0.5 defaults to off.
    "apply_query_key_layer_scaling": False,
    # The GeLU is the tanh approximation — Megatron's fused bias_gelu (trainer/ops/fused.py) — whichever
    # kernel Slipway ran; openai_gelu is the same function, so it stays False (Megatron allows one).
    # trainer.convert.spec._activation reads this back as gelu_new, transformers as gelu_fast (same tanh).
    "bias_gelu_fusion": True, "openai_gelu": False,
    # The weights use the legacy (non-core) GPT names (language_model.encoder.*) and Megatron's own layers.
    "use_legacy_models": True, "transformer_impl": "local",
    "virtual_pipeline_model_parallel_size": None, "num_layers_per_virtual_pipeline_stage": None,
    "data_parallel_random_init": False, "tokenizer_type": "GPT2BPETokenizer",
    "fp16": False, "bf16": False,
    # optim.distributed: the optimizer state is in distrib_optim.pt beside each shard (as Megatron's).
    "use_distributed_optimizer": False,
    # Megatron pickles a torch dtype here; a string keeps args plain. Neither reader compares it:
    # check_checkpoint_args skips it, load_args_from_checkpoint does not copy it, validate_args recomputes
    # it from fp16/bf16, transformers never reads it. It names the dtype of the saved `model` tensors
    # (Slipway keeps fp32 weights and trains bf16/fp16 under autocast).
    "params_dtype": "float32",
    "consumed_train_samples": 0, "consumed_valid_samples": 0,
}

def _as_megatron_parses(values: dict[str, Any]) -> None:
    """What Megatron-LM's parser and ``validate_args`` (core_v0.19.0, and earlier tags alike) hold for a
    model Slipway describes, where Slipway's own view would differ. Megatron-LM's ``load_checkpoint``
    compares add_position_embedding strictly (``check_checkpoint_args``), and ``--use-checkpoint-args``
    copies all four (``load_args_from_checkpoint``, force=True), so each must be the parser's value:

    - ``add_position_embedding``: True unless --no-position-embedding, which Slipway's models never need:
      with rope Megatron builds no position table whatever it says (GPTModel: learned_absolute only);
    - ``use_rotary_position_embeddings``: the deprecated flag, False; rope is position_embedding_type;
    - ``num_query_groups``: the parser's default 1 unless --group-query-attention (readers take the
      heads then: trainer.checkpoint.files._kv_groups, trainer.convert.spec);
    - ``add_qkv_bias``: validate_args sets it whenever add_bias_linear (from core_v0.10);
    - ``bias_gelu_fusion``: validate_args turns it off without linear biases, and Megatron's GeLU is then
      the erf form unless --openai-gelu: Slipway's tanh GeLU without biases is ``openai_gelu``.
    """
    values["add_position_embedding"] = True
    values["use_rotary_position_embeddings"] = False
    if not values.get("group_query_attention"):
        values["num_query_groups"] = 1
    bias = bool(values.get("add_bias_linear", True))
    values["add_qkv_bias"] = bool(values.get("add_qkv_bias")) or bias
    if not bias and values.get("bias_gelu_fusion"):
        values["bias_gelu_fusion"] = False
        values["openai_gelu"] = values.get("openai_gelu") or not values.get("swiglu")


_PLAIN = (bool, int, float, str, type(None))


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return isinstance(value, _PLAIN)


def megatron_args(fields: dict[str, Any]) -> argparse.Namespace:
    """The checkpoint ``args``: Slipway's GPT-2 architecture defaults, then ``fields`` (Megatron's names;
    extra Slipway fields such as run_id are kept — readers ignore attributes they do not know).

    Derives what follows from the shape: kv_channels, both epsilon names (``layernorm_epsilon``;
    ``norm_epsilon`` since Megatron core_v0.4.0), and the values Megatron-LM's own parser gives the same
    model (:func:`_as_megatron_parses`), field by field as its ``validate_args`` leaves them.
    """
    values = {**_GPT2_ARCHITECTURE, **fields}
    heads, hidden = values.get("num_attention_heads"), values.get("hidden_size")
    if heads and hidden:
        values.setdefault("kv_channels", hidden // heads)
    eps = values.get("norm_epsilon", values.get("layernorm_epsilon", 1e-5))
    values["norm_epsilon"] = values["layernorm_epsilon"] = eps
    _as_megatron_parses(values)
    missing = [k for k in READER_ARGS if k not in values]
    if missing:
        raise ValueError(f"checkpoint args lack {missing}, which Megatron-LM or transformers read; pass them "
                         "to trainer.checkpoint.megatron_args.megatron_args")
    odd = {k: type(v).__name__ for k, v in values.items() if not _plain(v)}
    if odd:
        raise TypeError(f"checkpoint args must be plain values (bool, int, float, str, list, dict, None) so "
                        f"the file loads without Slipway's or Megatron's classes; got {odd}: convert them "
                        "(e.g. str(path), a dtype's name)")
    return argparse.Namespace(**{k: list(v) if isinstance(v, tuple) else v for k, v in values.items()})
