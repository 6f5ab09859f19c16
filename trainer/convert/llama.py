"""Megatron/Slipway GPT ↔ Hugging Face ``LlamaForCausalLM`` tensors, by the one rules table's ``llama``
column (:data:`trainer.convert.names.RULES`).

A fused Megatron tensor is several HF ones: QKV rows per KV group ``[ng, (np/ng) q heads, k, v] × d``
(Megatron's --group-query-attention layout, what the GPT computes with) become ``q_proj`` [np·d, h],
``k_proj`` and ``v_proj`` [ng·d, h]; SwiGLU's ``[gate; up]`` becomes ``gate_proj`` and ``up_proj``.
HF's Linear stores [out, in] like Megatron, so nothing is transposed. No q/k row permutation is needed:
Slipway's rotary is the rotate-half layout (Megatron-core's default, ``rotary_interleaved=False``),
which is HF Llama's; only Meta's original interleaved checkpoints need the permutation HF's own
``convert_llama_weights_to_hf.py`` applies, and Megatron checkpoints trained with
``--rotary-interleaved`` are refused by :mod:`trainer.convert.spec`.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from trainer.convert.names import RULES, Rule, Shapes
from trainer.convert.names import TRANSFORMS as GPT2_TRANSFORMS

Tensors = tuple[torch.Tensor, ...]


def _split_qkv(t: torch.Tensor, s: Shapes) -> Tensors:
    rest, npg = t.shape[1:], s.num_heads // s.groups
    grouped = t.reshape(s.groups, npg + 2, -1, *rest)         # [ng, np/ng + 2, d, ...]
    return (grouped[:, :npg].reshape(-1, *rest).contiguous(), grouped[:, npg].reshape(-1, *rest).contiguous(),
            grouped[:, npg + 1].reshape(-1, *rest).contiguous())


def _join_qkv(parts: Tensors, s: Shapes) -> torch.Tensor:
    q, k, v = parts
    rest, npg = q.shape[1:], s.num_heads // s.groups
    if q.shape[0] != s.num_heads * k.shape[0] // s.groups or k.shape != v.shape:
        raise ValueError(f"q_proj {tuple(q.shape)}, k_proj {tuple(k.shape)}, v_proj {tuple(v.shape)} do not "
                         f"fit {s.num_heads} heads in {s.groups} KV groups")
    q = q.reshape(s.groups, npg, -1, *rest)
    k, v = k.reshape(s.groups, 1, -1, *rest), v.reshape(s.groups, 1, -1, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest).contiguous()


def _single(fn: Callable) -> tuple[Callable, Callable]:
    return (lambda t, s: (fn[0](t, s),), lambda parts, s: fn[1](parts[0], s))


ToHF = Callable[[torch.Tensor, Shapes], Tensors]
FromHF = Callable[[Tensors, Shapes], torch.Tensor]
# op → (Megatron tensor → HF tensors, HF tensors → Megatron tensor).
TRANSFORMS: dict[str, tuple[ToHF, FromHF]] = {
    "copy": _single(GPT2_TRANSFORMS["copy"]),
    "vocab": _single(GPT2_TRANSFORMS["vocab"]),
    "qkv": (_split_qkv, _join_qkv),
    "glu": (lambda t, s: tuple(c.contiguous() for c in t.chunk(2, dim=0)),
            lambda parts, s: torch.cat(parts, dim=0)),
}


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")


_BY_LLAMA = [(_pattern(name), rule, part) for rule in RULES for part, name in enumerate(rule.llama)]
_BY_MEGATRON = [(_pattern(rule.megatron), rule) for rule in RULES if rule.llama]


def match_hf(name: str) -> tuple[Rule, int | None, int] | None:
    """(rule, layer index, which of the rule's HF tensors) for a LlamaForCausalLM name, or None."""
    for pattern, rule, part in _BY_LLAMA:
        m = pattern.match(name)
        if m:
            return rule, int(m.group("i")) if "i" in m.groupdict() else None, part
    return None


def _match_megatron(name: str) -> tuple[Rule, int | None]:
    for pattern, rule in _BY_MEGATRON:
        m = pattern.match(name)
        if m:
            return rule, int(m.group("i")) if "i" in m.groupdict() else None
    raise KeyError(f"no LlamaForCausalLM name for Megatron parameter {name!r} (position embeddings and "
                   "LayerNorm biases have none: the model is not Llama-architecture)")


def megatron_to_hf(state: dict[str, torch.Tensor], shapes: Shapes) -> dict[str, torch.Tensor]:
    """Full Megatron state (flat names, global layers, padded vocab) → LlamaForCausalLM state."""
    out = {}
    for name, tensor in state.items():
        rule, i = _match_megatron(name)
        for hf_name, part in zip(rule.llama, TRANSFORMS[rule.llama_op][0](tensor, shapes), strict=True):
            out[hf_name.format(i=i)] = part
    return out


def hf_tensor(hf_name: str, state: dict[str, torch.Tensor], shapes: Shapes) -> torch.Tensor:
    """One HF tensor made from the full Megatron ``state`` (to write one tensor at a time)."""
    found = match_hf(hf_name)
    if found is None:
        raise KeyError(f"{hf_name!r} is not a LlamaForCausalLM parameter Slipway knows")
    rule, i, part = found
    return TRANSFORMS[rule.llama_op][0](state[rule.megatron.format(i=i)], shapes)[part]


def hf_to_megatron(state: dict[str, torch.Tensor], shapes: Shapes) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM state → full Megatron state (each fused tensor from all of its HF parts)."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    rules: dict[str, Rule] = {}
    for name, tensor in state.items():
        found = match_hf(name)
        if found is None:
            raise KeyError(f"{name!r} is not a LlamaForCausalLM parameter Slipway knows (rope scaling, "
                           "biases of another layout or a different model?)")
        rule, i, part = found
        key = rule.megatron.format(i=i)
        parts.setdefault(key, {})[part] = tensor
        rules[key] = rule
    out = {}
    for key, got in parts.items():
        rule = rules[key]
        if len(got) != len(rule.llama):
            missing = [n for j, n in enumerate(rule.llama) if j not in got]
            raise KeyError(f"{key} needs {missing} too; the HF state is incomplete")
        out[key] = TRANSFORMS[rule.llama_op][1](tuple(got[j] for j in range(len(rule.llama))), shapes)
    return out
