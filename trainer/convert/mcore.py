"""The ``model`` entry of a Megatron-core checkpoint shard (torch format), written and read.

Megatron-core's ``GPTModel`` (the default of current Megatron-LM, ``--use-mcore-models``) saves one flat
``OrderedDict`` per shard: ``embedding.*`` on the first stage, ``decoder.layers.{i}.*`` (local numbers),
``decoder.final_layernorm.*`` and ``output_layer.*`` on the last, plus an ``_extra_state`` entry (None)
for every linear module of the local spec. The names come from the one rules table
(:mod:`trainer.convert.names`, its ``mcore`` column); this module adds the order and the bookkeeping
entries so a Slipway shard has exactly the keys Megatron writes, and turns either format, in any naming
era, back into Slipway's names (:func:`normalise_names`, :func:`gpt_flat`), refusing other models with
the feature named.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from trainer.checkpoint.files import CheckpointError, arg
from trainer.convert import names
from trainer.model.names import flatten as flatten_legacy
from trainer.model.names import layer_index

LEGACY_PREFIX = "language_model."
LINEARS = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
EXTRA = "._extra_state"
# Megatron-core's order within a layer (its module registration order in the local spec).
_LAYER_ORDER = ("input_layernorm", "self_attention.linear_proj", "self_attention.linear_qkv",
                "pre_mlp_layernorm", "mlp.linear_fc1", "mlp.linear_fc2")


def _legacy(gpt_name: str) -> str:
    return gpt_name if gpt_name == names.HEAD_EMBEDDINGS else LEGACY_PREFIX + gpt_name


_LEAF_ORDER = ("weight", "bias", "_extra_state")


def _sort_key(mcore_name: str) -> tuple:
    leaf = _LEAF_ORDER.index(mcore_name.rsplit(".", 1)[1])
    if mcore_name.startswith("embedding."):
        return (0, "position" in mcore_name, 0, leaf)  # word embeddings first
    if mcore_name.startswith(names.MCORE_LAYERS):
        i, rest = mcore_name[len(names.MCORE_LAYERS):].split(".", 1)
        module = next(k for k, m in enumerate(_LAYER_ORDER) if rest.startswith(m + "."))
        return (1, int(i), module, leaf)
    return (2, mcore_name.startswith("output_layer"), 0, leaf)


def to_mcore_model(flat: dict[str, torch.Tensor], post_process: bool) -> OrderedDict:
    """A stage's flat GPT parameters (``named_parameters`` names) → Megatron-core's shard ``model``."""
    out: dict[str, Any] = {names.to_mcore(_legacy(n)): t for n, t in flat.items()}
    for layer in {layer_index(n) for n in out} - {None}:
        out.update({f"{names.MCORE_LAYERS}{layer}.{m}{EXTRA}": None for m in LINEARS})
    if post_process:
        out["output_layer" + EXTRA] = None
    return OrderedDict(sorted(out.items(), key=lambda kv: _sort_key(kv[0])))


def is_mcore_model(model: dict) -> bool:
    return not ({"language_model", "word_embeddings_for_head"} & set(model))


def normalise_names(flat: dict[str, Any], mcore: bool, where: object, untied: bool = False
                    ) -> dict[str, torch.Tensor]:
    """Flat parameter names of any era (legacy, legacy ≥ core_v0.4, Megatron-core, TE-style) → Slipway's
    legacy names, bookkeeping entries dropped; unknown names refused with the feature they suggest.
    ``untied``: the model has its own output layer (mcore's ``output_layer.weight`` is that, not the tied
    head's copy; :func:`untied_head` reads it from a shard's args)."""
    out, unknown = {}, []
    for raw, tensor in flat.items():
        if raw.endswith(names.IGNORED_SUFFIXES):
            continue
        name = names.from_mcore(raw, untied) if mcore else names.normalize(raw)
        if name is None or (name != names.HEAD_EMBEDDINGS and names.match(name) is None):
            unknown.append(raw)
            continue
        out[name] = tensor
    if unknown:
        raise CheckpointError(f"{where} is not a GPT checkpoint Slipway can convert "
                              f"({unsupported(unknown, mcore)}); unexpected parameters: "
                              f"{unknown[:6]}{' …' if len(unknown) > 6 else ''}")
    return out


# Parameter-name hints of Megatron models that are not a GPT-2- or Llama-architecture GPT. The T5 hint is
# the other family's stack: mcore GPT names all start with "decoder.", legacy ones hold "encoder." — so
# each format's own prefix must not count (q/k LayerNorm names once read as "T5" for that reason).
_VARIANTS = ((".experts.", "a mixture-of-experts (MoE) model"),
             (".router.", "a mixture-of-experts (MoE) model"),
             ("binary_head", "a BERT model"), ("lm_head.dense", "a BERT model"),
             ("linear_q_down_proj", "a multi-latent-attention model"),
             (".q_layernorm.", "a model with LayerNorm on queries and keys (--qk-layernorm)"),
             (".k_layernorm.", "a model with LayerNorm on queries and keys (--qk-layernorm)"))
_T5 = "an encoder-decoder (T5) model"


def unsupported(unknown: list[str], mcore: bool = True) -> str:
    """What the unexpected names say the model is (the README lists what Slipway converts)."""
    for hint, what in (*_VARIANTS, ("encoder." if mcore else "decoder.", _T5)):
        if any(hint in n for n in unknown):
            return f"it looks like {what}, which Slipway does not convert"
    return ("GPT-2 architecture (learned positions, LayerNorm, GeLU MLP, tied head) or Llama's (rope, "
            "RMSNorm, SwiGLU, grouped-query attention, untied head)")


def untied_head(args: Any) -> bool:
    """Whether a checkpoint's model has an untied output layer (Megatron's
    --untie-embeddings-and-output-weights)."""
    return bool(arg(args, "untie_embeddings_and_output_weights", False))


def gpt_flat(model: dict, where: str = "checkpoint", untied: bool = False) -> dict[str, torch.Tensor]:
    """A shard's ``model`` in either format and any naming era → the GPT's flat parameter names
    (bookkeeping entries dropped; unknown names refused as :func:`normalise_names` does)."""
    mcore = is_mcore_model(model)
    flat = model if mcore else {_legacy(n): t for n, t in flatten_legacy(model).items()}
    return {n.removeprefix(LEGACY_PREFIX): t for n, t in normalise_names(flat, mcore, where, untied).items()}
