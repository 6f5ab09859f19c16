"""Layout-independent initialisation: every parameter's *full* tensor is drawn from its own generator,
seeded by (seed, global parameter name), and then sliced to this rank's shard.

So for one seed every (tp, pp) layout starts from the same full weights, whichever stage builds which
layers and however the tensors are split. Rules (Megatron / GPT-2): weights N(0, init_std); the two
output projections (``self_attention.dense`` and ``mlp.dense_4h_to_h``) N(0, init_std / sqrt(2·layers));
biases 0; LayerNorm/RMSNorm weight 1, bias 0; the untied head (``output_layer``) N(0, init_std) from
its own seed; padded vocabulary rows 0 (they are never looked up and are excluded
from the loss). A module may shard a full tensor by defining ``shard_param(name, full) -> Tensor`` and
``full_shape(name) -> torch.Size`` (the tensor-parallel layers do).
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from trainer.config.model import ModelConfig

_OUTPUT_PROJECTIONS = ("self_attention.dense.weight", "mlp.dense_4h_to_h.weight")
_TIED = ("embedding.word_embeddings.weight", "word_embeddings_for_head.weight")
_VOCAB_ROWS = (*_TIED, "output_layer.weight")  # padded vocabulary rows stay zero (the untied head too)


def param_seed(seed: int, global_name: str) -> int:
    """A stable 63-bit seed for one parameter (crc32 of the name; ``hash()`` is salted per process)."""
    if global_name in _TIED:  # the head's copy must start equal to the word embeddings
        global_name = _TIED[0]
    return (seed * 1_000_003 + zlib.crc32(global_name.encode())) % (2**63)


def full_init(cfg: ModelConfig, global_name: str, full_shape: torch.Size, seed: int) -> torch.Tensor:
    """The full (unsharded) fp32 CPU tensor for a parameter, drawn from its own generator."""
    leaf = global_name.rsplit(".", 1)[-1]
    if "layernorm" in global_name:
        return torch.ones(full_shape) if leaf == "weight" else torch.zeros(full_shape)
    if leaf == "bias":
        return torch.zeros(full_shape)
    std = cfg.init_std
    if global_name.endswith(_OUTPUT_PROJECTIONS):
        std = cfg.init_std / math.sqrt(2.0 * cfg.num_layers)
    gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, global_name))
    if global_name in _VOCAB_ROWS:
        # Draw only the true vocabulary so that rows do not depend on the TP-dependent padding.
        full = torch.zeros(full_shape)
        full[: cfg.vocab_size].normal_(0.0, std, generator=gen)
        return full
    return torch.empty(full_shape).normal_(0.0, std, generator=gen)


def materialize(model: nn.Module, device: torch.device | str, dtype: torch.dtype | None = None) -> None:
    """Give every meta-device parameter real (uninitialised) storage on ``device`` (in ``dtype``).

    Like ``Module.to_empty``, but allocates with ``torch.empty`` directly: ``empty_like`` on a meta
    tensor goes through Python decompositions that import sympy (seconds per process).
    """
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                data = torch.empty(p.shape, dtype=dtype or p.dtype, device=device)
                module._parameters[name] = nn.Parameter(data, requires_grad=p.requires_grad)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter of ``model`` (a GPT or one stage, possibly with TP layers) in place.

    ``model`` must have a ``global_name(local_name)`` method and a ``cfg`` (as :class:`GPT` does);
    parameters must already live on their final device (e.g. after :func:`materialize`).
    """
    for mod_name, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            local = f"{mod_name}.{pname}" if mod_name else pname
            full_shape = module.full_shape(pname) if hasattr(module, "full_shape") else param.shape
            full = full_init(model.cfg, model.global_name(local), torch.Size(full_shape), seed)
            if hasattr(module, "shard_param"):
                full = module.shard_param(pname, full)
            if full.shape != param.shape:
                raise RuntimeError(f"init of {local}: shard shape {tuple(full.shape)} != parameter "
                                   f"shape {tuple(param.shape)}")
            param.copy_(full)
