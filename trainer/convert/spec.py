"""The architecture of a checkpointed GPT, read from its args and checked against its weights.

Slipway and Megatron-LM both store ``args`` as an ``argparse.Namespace`` with Megatron's names (older
Slipway checkpoints: a dict; :func:`trainer.checkpoint.files.arg` reads either). Two families convert:
GPT-2 architecture (``GPT2LMHeadModel``) and Llama's (rope, RMSNorm, SwiGLU, any number of KV groups,
with or without biases and tied head: ``LlamaForCausalLM``). Options neither has (post-LN residuals,
mixture of experts, fp8 Transformer Engine weights, interleaved rotary, q/k LayerNorm, mixes of the two
families) are refused with the option named and the fix (:func:`unsupported_options`; the trainer's
checkpoint.load refuses the same list).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer.checkpoint.files import arg  # the one accessor; convert/ modules also import it from here
from trainer.config.model import MEGATRON_NORMALIZATION, MEGATRON_POSITION
from trainer.convert import names
from trainer.convert.shard_io import CheckpointError

EOD_TOKEN = "<|endoftext|>"
GPT2, LLAMA = "gpt2", "llama"  # the Hugging Face architectures a checkpoint converts to

# (arg, value every convertible model has, what it means, the fix) — any other value converts to neither
# GPT2LMHeadModel nor LlamaForCausalLM, and Slipway's GPT (checkpoint.load) has no such option either.
_RETRAIN = "train the model without "
_UNSUPPORTED = (
    ("apply_residual_connection_post_layernorm", False, "post-LayerNorm residual",
     _RETRAIN + "--apply-residual-connection-post-layernorm"),
    ("num_experts", None, "mixture of experts",
     "Slipway converts dense GPTs only: train without --num-experts, or convert with a tool that writes a "
     "mixture-of-experts architecture (e.g. MixtralForCausalLM)"),
    ("fp8", None, "fp8 (Transformer Engine) training", _RETRAIN + "--fp8-format"),
    ("rotary_interleaved", False, "interleaved rotary layout (Slipway and HF Llama rotate halves)",
     _RETRAIN + "--rotary-interleaved (Megatron's default rotates halves)"),
    ("apply_layernorm_1p", False, "LayerNorm with 1 + weight", _RETRAIN + "--apply-layernorm-1p"),
    ("qk_layernorm", False, "LayerNorm on queries and keys (neither architecture has one)",
     _RETRAIN + "--qk-layernorm"),
)
_POSITIONS = {v: k for k, v in MEGATRON_POSITION.items()}
_NORMS = {v: k for k, v in MEGATRON_NORMALIZATION.items()}


@dataclass(frozen=True)
class GPTSpec:
    """Shapes and numerics of a convertible model: GPT-2 architecture (the defaults) or Llama's."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    max_position_embeddings: int
    vocab_size: int  # the tokenizer's real size: HF rows
    padded_vocab_size: int  # Megatron rows, vocab padded to a multiple of 128·TP
    layernorm_epsilon: float = 1e-5  # every norm's epsilon (Megatron's norm_epsilon)
    activation: str = "gelu_new"  # HF name: gelu_new = tanh GeLU (Megatron's fused bias-GeLU); silu: SwiGLU
    checkpoint_version: float = 3.0
    position_embedding: str = "learned"  # learned | rope (trainer.config.model)
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    normalization: str = "layernorm"  # layernorm | rmsnorm
    num_query_groups: int | None = None  # None: num_attention_heads
    add_bias_linear: bool = True
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                             f"{self.num_attention_heads}")
        if not 0 < self.vocab_size <= self.padded_vocab_size:
            raise ValueError(f"vocab_size={self.vocab_size} must be in 1..padded_vocab_size="
                             f"{self.padded_vocab_size} (the tokenizer does not fit the embedding table)")
        if self.activation not in ("gelu_new", "gelu", "silu"):
            raise ValueError(f"activation={self.activation!r}: use gelu_new (tanh), gelu (erf) or silu "
                             "(SwiGLU)")

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def family(self) -> str | None:
        """GPT2, LLAMA, or None for a mix of options neither HF architecture has."""
        gpt2 = (self.position_embedding == "learned" and self.normalization == "layernorm"
                and self.activation != "silu" and self.query_groups == self.num_attention_heads
                and self.add_bias_linear and self.tie_word_embeddings)
        llama = (self.position_embedding == "rope" and self.normalization == "rmsnorm"
                 and self.activation == "silu" and self.rotary_percent == 1.0)
        return GPT2 if gpt2 else LLAMA if llama else None

    def check_family(self) -> str:
        """The family, or a CheckpointError naming what makes the model neither GPT-2 nor Llama."""
        if self.family is None:
            arch = {"position_embedding_type": MEGATRON_POSITION[self.position_embedding],
                    "normalization": MEGATRON_NORMALIZATION[self.normalization],
                    "swiglu": self.activation == "silu", "rotary_percent": self.rotary_percent,
                    "num_query_groups": self.query_groups, "add_bias_linear": self.add_bias_linear,
                    "untie_embeddings_and_output_weights": not self.tie_word_embeddings}
            raise CheckpointError(
                "the model mixes options no Hugging Face architecture Slipway writes has ("
                + ", ".join(f"{k}={v!r}" for k, v in arch.items()) + "): GPT2LMHeadModel needs learned "
                "positions, LayerNorm, GeLU, num_query_groups = heads, biases and a tied head; "
                "LlamaForCausalLM needs rope with rotary_percent 1, RMSNorm and SwiGLU")
        return self.family

    def model_config(self) -> dict:
        """The trainer's ``model`` section fields (trainer.config.ModelConfig) of this spec."""
        return {"num_layers": self.num_layers, "hidden_size": self.hidden_size,
                "num_attention_heads": self.num_attention_heads, "ffn_hidden_size": self.ffn_hidden_size,
                "seq_length": self.max_position_embeddings, "vocab_size": self.vocab_size,
                "max_position_embeddings": self.max_position_embeddings,
                "norm_epsilon": self.layernorm_epsilon,
                "position_embedding": self.position_embedding, "rotary_base": self.rotary_base,
                "rotary_percent": self.rotary_percent, "normalization": self.normalization,
                "activation": "swiglu" if self.activation == "silu" else "gelu",
                "num_query_groups": self.query_groups, "add_bias_linear": self.add_bias_linear,
                "tie_word_embeddings": self.tie_word_embeddings}

    @property
    def shapes(self) -> names.Shapes:
        return names.Shapes(self.num_attention_heads, self.vocab_size, self.padded_vocab_size,
                            self.checkpoint_version, self.query_groups)


def _activation(args: Any) -> str:
    """Megatron: --swiglu is SiLU-gated; fused bias-GeLU and openai_gelu are the tanh form; plain F.gelu
    is erf."""
    if isinstance(args, dict) or args is None:
        return "silu" if arg(args, "swiglu", False) else "gelu_new"  # Slipway's GeLU is always tanh
    if arg(args, "swiglu", False):
        return "silu"
    if arg(args, "bias_gelu_fusion", True) or arg(args, "openai_gelu", False):
        return "gelu_new"
    return "gelu"


def unsupported_options(args: Any) -> list[str]:
    """The Megatron options in ``args`` that neither GPT2LMHeadModel, LlamaForCausalLM nor Slipway's GPT
    has, each with its value, its meaning and the fix; [] for a convertible model."""
    found = []
    for key, needed, what, fix in _UNSUPPORTED:
        value = arg(args, key, needed)
        if value != needed and not (needed is None and not value):
            found.append(f"{key}={value!r} ({what}; GPT2LMHeadModel and LlamaForCausalLM need {needed!r}); "
                         f"fix: {fix}")
    # Since core_v0.10.0 validate_args sets add_qkv_bias=True whenever add_bias_linear is (every linear
    # biased, GPT-2's case); only with add_bias_linear=False does it mean a bias on the QKV projection alone.
    if arg(args, "add_qkv_bias", False) and not arg(args, "add_bias_linear", True):
        found.append("add_qkv_bias=True with add_bias_linear=False (a bias on the QKV projection only, the "
                     "other linear layers have none; GPT2LMHeadModel has biases on every linear layer and "
                     "LlamaForCausalLM on none); fix: train without --add-qkv-bias, or with biases on every "
                     "linear layer (no --disable-bias-linear)")
    for key, table in (("position_embedding_type", _POSITIONS), ("normalization", _NORMS)):
        value = arg(args, key, None)
        if value is not None and value not in table:
            found.append(f"{key}={value!r}; Slipway knows {sorted(table)}")
    return found


def check_convertible(args: Any) -> None:
    """Refuse Megatron options that neither GPT2LMHeadModel nor LlamaForCausalLM has."""
    found = unsupported_options(args)
    if found:
        raise CheckpointError("this checkpoint cannot be converted: " + "; and ".join(found))


def _required(args: Any, key: str, fallback: int | None) -> int:
    value = arg(args, key, fallback)
    if value is None:
        raise CheckpointError(f"the checkpoint's args have no {key!r}, and the weights cannot tell it; "
                              "was it written by Slipway or Megatron-LM?")
    return int(value)


def _observed(args: Any, state: dict[str, torch.Tensor]) -> dict[str, int]:
    """Shapes read from the merged weights (the position table only where positions are learned)."""
    wte = state[names.WORD_EMBEDDINGS]
    h_to_4h = state[names.ENCODER + "layers.0.mlp.dense_h_to_4h.weight"]
    ffn = state[names.ENCODER + "layers.0.mlp.dense_4h_to_h.weight"].shape[1]
    swiglu = bool(arg(args, "swiglu", False))
    if h_to_4h.shape[0] != (2 if swiglu else 1) * ffn:
        raise CheckpointError(f"dense_h_to_4h has {h_to_4h.shape[0]} rows for ffn_hidden_size={ffn}, which "
                              f"does not fit args swiglu={swiglu}: the args do not belong to these weights")
    observed = {"num_layers": sum(1 for n in state if n.endswith(".input_layernorm.weight")),
                "hidden_size": wte.shape[1], "ffn_hidden_size": ffn, "padded_vocab_size": wte.shape[0]}
    if names.POSITION_EMBEDDINGS in state:
        observed["max_position_embeddings"] = state[names.POSITION_EMBEDDINGS].shape[0]
    return observed


def spec_from_checkpoint(args: Any, state: dict[str, torch.Tensor], version: float,
                         vocab_size: int | None) -> GPTSpec:
    """The spec from args, with shapes read from the merged weights and checked against args."""
    check_convertible(args)
    observed = _observed(args, state)
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
    max_pos = observed.get("max_position_embeddings") or _required(
        args, "max_position_embeddings", arg(args, "seq_length"))
    groups = arg(args, "num_query_groups") if arg(args, "group_query_attention", False) else None
    return GPTSpec(num_layers=observed["num_layers"], hidden_size=observed["hidden_size"],
                   num_attention_heads=heads, ffn_hidden_size=observed["ffn_hidden_size"],
                   max_position_embeddings=max_pos, vocab_size=int(vocab_size),
                   padded_vocab_size=observed["padded_vocab_size"],
                   layernorm_epsilon=float(arg(args, "norm_epsilon", arg(args, "layernorm_epsilon", 1e-5))),
                   activation=_activation(args), checkpoint_version=version,
                   position_embedding=_POSITIONS[arg(args, "position_embedding_type", "learned_absolute")],
                   rotary_base=float(arg(args, "rotary_base", 10000)),
                   rotary_percent=float(arg(args, "rotary_percent", 1.0)),
                   normalization=_NORMS[arg(args, "normalization", "LayerNorm")],
                   num_query_groups=int(groups) if groups else None,
                   add_bias_linear=bool(arg(args, "add_bias_linear", True)),
                   tie_word_embeddings=not arg(args, "untie_embeddings_and_output_weights", False))
