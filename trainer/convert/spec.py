"""The architecture of a checkpointed GPT, read from its args and checked against its weights.

Slipway and Megatron-LM both store ``args`` as an ``argparse.Namespace`` with Megatron's names (older
Slipway checkpoints: a dict; :func:`trainer.checkpoint.layout.arg` reads either). Options that make a
Megatron model something other than GPT-2 (rotary positions, RMSNorm, SwiGLU, grouped-query attention,
an untied head, post-LN residuals, mixture of experts, fp8 Transformer Engine weights) are refused with
the option named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer.checkpoint.layout import arg  # the one accessor; convert/ modules also import it from here
from trainer.convert import names
from trainer.convert.layout import CheckpointError

EOD_TOKEN = "<|endoftext|>"

# (arg, value that GPT-2 needs, what it means) — any other value is not convertible to GPT2LMHeadModel.
_GPT2_ONLY = (
    ("position_embedding_type", "learned_absolute", "position embeddings"),
    ("normalization", "LayerNorm", "normalisation"),
    ("swiglu", False, "SwiGLU MLP"),
    ("group_query_attention", False, "grouped-query attention"),
    ("untie_embeddings_and_output_weights", False, "untied output layer"),
    ("apply_residual_connection_post_layernorm", False, "post-LayerNorm residual"),
    ("add_bias_linear", True, "linear biases"),
    ("num_experts", None, "mixture of experts"),
    ("fp8", None, "fp8 (Transformer Engine) training"),
)


@dataclass(frozen=True)
class GPTSpec:
    """Shapes and numerics of a GPT-2-architecture model."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    max_position_embeddings: int
    vocab_size: int  # the tokenizer's real size: HF rows
    padded_vocab_size: int  # Megatron rows, vocab padded to a multiple of 128·TP
    layernorm_epsilon: float = 1e-5
    activation: str = "gelu_new"  # HF name: gelu_new = tanh approximation (Megatron's fused bias-GeLU)
    checkpoint_version: float = 3.0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                             f"{self.num_attention_heads}")
        if not 0 < self.vocab_size <= self.padded_vocab_size:
            raise ValueError(f"vocab_size={self.vocab_size} must be in 1..padded_vocab_size="
                             f"{self.padded_vocab_size} (the tokenizer does not fit the embedding table)")
        if self.activation not in ("gelu_new", "gelu"):
            raise ValueError(f"activation={self.activation!r}: use gelu_new (tanh) or gelu (erf)")

    @property
    def shapes(self) -> names.Shapes:
        return names.Shapes(self.num_attention_heads, self.vocab_size, self.padded_vocab_size,
                            self.checkpoint_version)


def _activation(args: Any) -> str:
    """Megatron: fused bias-GeLU and openai_gelu are the tanh form; plain F.gelu is erf."""
    if isinstance(args, dict) or args is None:
        return "gelu_new"  # Slipway always uses the tanh approximation
    if arg(args, "bias_gelu_fusion", True) or arg(args, "openai_gelu", False):
        return "gelu_new"
    return "gelu"


def check_gpt2_args(args: Any) -> None:
    """Refuse Megatron options that are not GPT-2 architecture."""
    for key, needed, what in _GPT2_ONLY:
        value = arg(args, key, needed)
        if value != needed and not (needed is None and not value):
            raise CheckpointError(f"this checkpoint is not a GPT-2-architecture GPT: {key}={value!r} "
                                  f"({what}); GPT2LMHeadModel needs {needed!r}")


def _required(args: Any, key: str, fallback: int | None) -> int:
    value = arg(args, key, fallback)
    if value is None:
        raise CheckpointError(f"the checkpoint's args have no {key!r}, and the weights cannot tell it; "
                              "was it written by Slipway or Megatron-LM?")
    return int(value)


def spec_from_checkpoint(args: Any, state: dict[str, torch.Tensor], version: float,
                         vocab_size: int | None) -> GPTSpec:
    """The spec from args, with shapes read from the merged weights and checked against args."""
    check_gpt2_args(args)
    wpe = state[names.POSITION_EMBEDDINGS]
    wte = state[names.WORD_EMBEDDINGS]
    h_to_4h = state[names.ENCODER + "layers.0.mlp.dense_h_to_4h.weight"]
    num_layers = sum(1 for n in state if n.endswith(".input_layernorm.weight"))
    observed = {"num_layers": num_layers, "hidden_size": wpe.shape[1],
                "max_position_embeddings": wpe.shape[0], "ffn_hidden_size": h_to_4h.shape[0],
                "padded_vocab_size": wte.shape[0]}
    for key, seen in observed.items():
        stated = arg(args, key)
        if stated is not None and int(stated) != seen:
            raise CheckpointError(f"args say {key}={stated} but the weights have {seen}: the args do not "
                                  "belong to these weights")
    if vocab_size is None:
        vocab_size = arg(args, "vocab_size")
    if vocab_size is None:
        raise CheckpointError("the real vocabulary size is unknown (args have no vocab_size and no tokenizer "
                              "was found); pass --vocab-file/--merge-file of the run's tokenizer")
    heads = _required(args, "num_attention_heads", None)
    return GPTSpec(num_layers=num_layers, hidden_size=wpe.shape[1], num_attention_heads=heads,
                   ffn_hidden_size=h_to_4h.shape[0], max_position_embeddings=wpe.shape[0],
                   vocab_size=int(vocab_size), padded_vocab_size=wte.shape[0],
                   layernorm_epsilon=float(arg(args, "norm_epsilon", arg(args, "layernorm_epsilon", 1e-5))),
                   activation=_activation(args), checkpoint_version=version)
