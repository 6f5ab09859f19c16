"""Megatron legacy checkpoint layout for the GPT's (or one stage's / one TP shard's) parameters.

The GPT's flat parameter names already are Megatron's (see trainer.model.gpt); Megatron nests them in
``model_optim_rng.pt['model']`` as (formats.md §4):

    {'language_model': {'embedding': {'word_embeddings': {'weight': T}, 'position_embeddings': {'weight': T}},
                        'encoder': {'layers.0.input_layernorm.weight': T, ..., 'final_layernorm.bias': T}},
     'word_embeddings_for_head': {'weight': T}}          # last PP stage without the embedding only

An untied head (Llama) is ``language_model.output_layer.weight`` on the last stage.

Encoder layer indices are local to the pipeline stage (as Megatron writes them); a stage's first global
layer is ``model.encoder.layer_offset``. Under TP every tensor is this rank's shard: column-parallel
(query_key_value, dense_h_to_4h: weight and bias; word embeddings) split on dim 0, row-parallel
(self_attention.dense, dense_4h_to_h) weights on dim 1 with replicated biases; LayerNorms and position
embeddings replicated: the one table of these rules is ``trainer.parallel.sharding``.
"""

from __future__ import annotations

import re

import torch
from torch import nn

LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # GPT (encoder.layers.i.) and Megatron names alike
_EMBEDDING = "embedding."
_ENCODER = "encoder."
_HEAD = "word_embeddings_for_head."
_OUTPUT = "output_layer."  # the untied head: language_model.output_layer in Megatron's legacy layout


def layer_index(name: str) -> int | None:
    """The layer number in ``…layers.{i}.…``, or None for a parameter outside the layers."""
    m = LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def renumber(name: str, offset: int) -> str:
    """``…layers.{i}.…`` → ``…layers.{i + offset}.…`` (local ↔ global layer numbers)."""
    m = LAYER_RE.search(name)
    if m is None or not offset:
        return name
    start, end = m.span(1)
    return f"{name[:start]}{int(m.group(1)) + offset}{name[end:]}"


def nest(flat: dict[str, torch.Tensor]) -> dict:
    """Flat GPT parameter names → Megatron's nested ``model`` dict."""
    out: dict = {}
    for name, tensor in flat.items():
        if name.startswith(_EMBEDDING):
            module, leaf = name[len(_EMBEDDING):].split(".", 1)
            lm = out.setdefault("language_model", {}).setdefault("embedding", {})
            lm.setdefault(module, {})[leaf] = tensor
        elif name.startswith(_ENCODER):
            out.setdefault("language_model", {}).setdefault("encoder", {})[name[len(_ENCODER):]] = tensor
        elif name.startswith(_OUTPUT):
            out.setdefault("language_model", {}).setdefault("output_layer", {})[name[len(_OUTPUT):]] = tensor
        elif name.startswith(_HEAD):
            out.setdefault("word_embeddings_for_head", {})[name[len(_HEAD):]] = tensor
        else:
            raise KeyError(f"parameter {name!r} has no place in Megatron's GPT layout")
    return out


def flatten(nested: dict) -> dict[str, torch.Tensor]:
    """Megatron's nested ``model`` dict → flat GPT parameter names (the inverse of :func:`nest`)."""
    flat: dict[str, torch.Tensor] = {}
    lm = nested.get("language_model", {})
    for module, leaves in lm.get("embedding", {}).items():
        for leaf, tensor in leaves.items():
            flat[f"{_EMBEDDING}{module}.{leaf}"] = tensor
    for name, tensor in lm.get("encoder", {}).items():
        flat[_ENCODER + name] = tensor
    for leaf, tensor in lm.get("output_layer", {}).items():
        flat[_OUTPUT + leaf] = tensor
    for leaf, tensor in nested.get("word_embeddings_for_head", {}).items():
        flat[_HEAD + leaf] = tensor
    unknown = set(nested) - {"language_model", "word_embeddings_for_head"}
    unknown |= set(lm) - {"embedding", "encoder", "output_layer"}
    if unknown:
        raise KeyError(f"unexpected keys in a Megatron GPT model dict: {sorted(unknown)}")
    return flat


def megatron_state_dict(model: nn.Module) -> dict:
    """This module's parameters (this rank's shard) in Megatron's nested layout (detached, not copied)."""
    return nest({name: p.detach() for name, p in model.named_parameters()})


@torch.no_grad()
def load_megatron_state_dict(model: nn.Module, nested: dict) -> None:
    """Copy a nested Megatron ``model`` dict for exactly this module's shard into its parameters."""
    flat = flatten(nested)
    params = dict(model.named_parameters())
    missing, unexpected = sorted(set(params) - set(flat)), sorted(set(flat) - set(params))
    if missing or unexpected:
        raise KeyError(f"checkpoint does not match this model shard: missing {missing}, "
                       f"unexpected {unexpected} (wrong tp/pp rank or layer split?)")
    for name, param in params.items():
        if flat[name].shape != param.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(flat[name].shape)} != model shape "
                             f"{tuple(param.shape)} (different tp_size, vocab padding or model size?)")
        param.copy_(flat[name])
