"""The declarative name map between Slipway/Megatron GPT parameters and Hugging Face ``GPT2LMHeadModel``
/ ``LlamaForCausalLM``.

One table (:data:`RULES`) says, for every parameter, its Megatron legacy name (``formats.md`` §4), its
GPT-2 HF name (§5), its Megatron-core name, its ``LlamaForCausalLM`` names (a fused Megatron tensor may
be several HF ones: QKV → q/k/v_proj, SwiGLU's [gate; up] → gate/up_proj; the transforms are in
:mod:`trainer.convert.llama`), the tensor transform between them, which pipeline stage holds it and which
model options it exists under (``only``: e.g. no position table with rope); how tensor parallelism
shards it is read from the trainer's one sharding table (``trainer.parallel.sharding``). Both directions are
derived from that table: the inverse map is the same rules read right to left with each transform's
inverse, so the two directions cannot drift apart.

Names here are *flat* (dotted) and use *global* layer indices; nesting and per-stage local indices are
the checkpoint layer's business (:mod:`trainer.convert.shards`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trainer.parallel import sharding

ENCODER = "language_model.encoder."
WORD_EMBEDDINGS = "language_model.embedding.word_embeddings.weight"
POSITION_EMBEDDINGS = "language_model.embedding.position_embeddings.weight"
HEAD_EMBEDDINGS = "word_embeddings_for_head.weight"  # tied LM head copy on a last PP stage (PP > 1)

# Which pipeline stage holds it.
FIRST, LAYER, LAST = "first", "layer", "last"


@dataclass(frozen=True)
class Rule:
    """One parameter: Megatron and HF names (``{i}``: global layer index), transform, PP placement."""

    megatron: str
    hf: str
    op: str  # key of TRANSFORMS
    stage: str  # FIRST | LAYER | LAST
    mcore: str  # Megatron-core GPTModel's name (the same tensor, the same layout)
    llama: tuple[str, ...] = ()  # LlamaForCausalLM's names ({i}: global layer), () where Llama has none
    llama_op: str = "copy"  # key of trainer.convert.llama.TRANSFORMS
    only: str = ""  # the model feature it exists under (FEATURES); "" = every GPT

    @property
    def tp(self) -> str:
        """COLUMN | ROW | REPLICATED | VOCAB, from the sharding table."""
        return sharding.kind(self.megatron.replace("{i}", "0"))


# Features a parameter may depend on (Rule.only); :func:`features` derives a model's set from its args.
LEARNED_POSITIONS, LAYERNORM_BIAS = "learned_positions", "layernorm_bias"
LINEAR_BIAS, UNTIED = "linear_bias", "untied"
GPT2_FEATURES = frozenset({LEARNED_POSITIONS, LAYERNORM_BIAS, LINEAR_BIAS})


def _layer(megatron: str, hf: str, op: str, mcore: str, llama: tuple[str, ...] = (), llama_op: str = "copy",
           only: str = "") -> Rule:
    return Rule(ENCODER + "layers.{i}." + megatron, "transformer.h.{i}." + hf, op, LAYER,
                MCORE_LAYERS + "{i}." + mcore, tuple(LLAMA_LAYERS + "{i}." + n for n in llama), llama_op,
                only)


MCORE_LAYERS = "decoder.layers."
MCORE_HEAD = "output_layer.weight"  # mcore's tied head copy on a last stage, and its untied head
OUTPUT_LAYER = "language_model.output_layer.weight"  # the untied head (Llama)
LLAMA_LAYERS = "model.layers."
_ATTN, _MLP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")

RULES: tuple[Rule, ...] = (
    Rule(WORD_EMBEDDINGS, "transformer.wte.weight", "vocab", FIRST, "embedding.word_embeddings.weight",
         ("model.embed_tokens.weight",), "vocab"),
    Rule(POSITION_EMBEDDINGS, "transformer.wpe.weight", "copy", FIRST,
         "embedding.position_embeddings.weight", only=LEARNED_POSITIONS),
    _layer("input_layernorm.weight", "ln_1.weight", "copy", "input_layernorm.weight",
           ("input_layernorm.weight",)),
    _layer("input_layernorm.bias", "ln_1.bias", "copy", "input_layernorm.bias", only=LAYERNORM_BIAS),
    _layer("self_attention.query_key_value.weight", "attn.c_attn.weight", "qkv_weight",
           "self_attention.linear_qkv.weight", tuple(f"self_attn.{p}.weight" for p in _ATTN), "qkv"),
    _layer("self_attention.query_key_value.bias", "attn.c_attn.bias", "qkv_bias",
           "self_attention.linear_qkv.bias", tuple(f"self_attn.{p}.bias" for p in _ATTN), "qkv",
           only=LINEAR_BIAS),
    _layer("self_attention.dense.weight", "attn.c_proj.weight", "transpose",
           "self_attention.linear_proj.weight", ("self_attn.o_proj.weight",)),
    _layer("self_attention.dense.bias", "attn.c_proj.bias", "copy", "self_attention.linear_proj.bias",
           ("self_attn.o_proj.bias",), only=LINEAR_BIAS),
    _layer("post_attention_layernorm.weight", "ln_2.weight", "copy", "pre_mlp_layernorm.weight",
           ("post_attention_layernorm.weight",)),
    _layer("post_attention_layernorm.bias", "ln_2.bias", "copy", "pre_mlp_layernorm.bias",
           only=LAYERNORM_BIAS),
    _layer("mlp.dense_h_to_4h.weight", "mlp.c_fc.weight", "transpose", "mlp.linear_fc1.weight",
           tuple(f"mlp.{p}.weight" for p in _MLP), "glu"),
    _layer("mlp.dense_h_to_4h.bias", "mlp.c_fc.bias", "copy", "mlp.linear_fc1.bias",
           tuple(f"mlp.{p}.bias" for p in _MLP), "glu", only=LINEAR_BIAS),
    _layer("mlp.dense_4h_to_h.weight", "mlp.c_proj.weight", "transpose", "mlp.linear_fc2.weight",
           ("mlp.down_proj.weight",)),
    _layer("mlp.dense_4h_to_h.bias", "mlp.c_proj.bias", "copy", "mlp.linear_fc2.bias",
           ("mlp.down_proj.bias",), only=LINEAR_BIAS),
    Rule(ENCODER + "final_layernorm.weight", "transformer.ln_f.weight", "copy", LAST,
         "decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule(ENCODER + "final_layernorm.bias", "transformer.ln_f.bias", "copy", LAST,
         "decoder.final_layernorm.bias", only=LAYERNORM_BIAS),
    # GPT-2 has no untied head (its lm_head is wte): no GPT-2 name ("").
    Rule(OUTPUT_LAYER, "", "vocab", LAST, MCORE_HEAD, ("lm_head.weight",), "vocab", only=UNTIED),
)

# Naming eras of Megatron's legacy model, normalised on read, never written: older releases call the
# encoder "transformer" and the attention block "attention"; since core_v0.4.0 the norms are
# input_norm / post_attention_norm / final_norm.
ALIASES: tuple[tuple[str, str], ...] = (
    ("language_model.transformer.", ENCODER),
    (".attention.query_key_value.", ".self_attention.query_key_value."),
    (".attention.dense.", ".self_attention.dense."),
    (".input_norm.", ".input_layernorm."),
    (".post_attention_norm.", ".post_attention_layernorm."),
    (ENCODER + "final_norm.", ENCODER + "final_layernorm."),
)
# Megatron-core with Transformer-Engine-style names (torch_dist checkpoints of the local spec too): the
# layer norms are stored inside the linear they feed. Normalised to mcore's own names on read.
MCORE_ALIASES: tuple[tuple[str, str], ...] = (
    (".self_attention.linear_qkv.layer_norm_", ".input_layernorm."),
    (".mlp.linear_fc1.layer_norm_", ".pre_mlp_layernorm."),
)
IGNORED_SUFFIXES = ("._extra_state", ".attn.bias", ".attn.masked_bias")


@dataclass(frozen=True)
class Shapes:
    """What the transforms need to know about the model."""

    num_heads: int
    vocab_size: int  # the tokenizer's real size (HF rows)
    padded_vocab_size: int  # Megatron rows (vocab padded to a multiple of 128·TP)
    checkpoint_version: float = 3.0
    num_query_groups: int | None = None  # KV heads (GQA); None: num_heads

    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_heads


def _qkv_to_hf(t: torch.Tensor, s: Shapes) -> torch.Tensor:
    """Megatron per-head rows [heads, 3, hd] (v ≥ 2.0) or [heads, hd, 3] (v1.0) → HF [3, heads, hd]."""
    rest = t.shape[1:]
    if s.checkpoint_version >= 2.0:
        t = t.reshape(s.num_heads, 3, -1, *rest).transpose(0, 1)
    elif s.checkpoint_version == 1.0:
        t = t.reshape(s.num_heads, -1, 3, *rest).permute(2, 0, 1, *range(3, 3 + len(rest)))
    # version 0 already stores [3, heads, hd].
    return t.reshape(-1, *rest).contiguous()


def _qkv_from_hf(t: torch.Tensor, s: Shapes) -> torch.Tensor:
    """HF [3, heads, hd] rows → Megatron v ≥ 2.0 per-head rows [heads, 3, hd] (the only layout we write)."""
    rest = t.shape[1:]
    return t.reshape(3, s.num_heads, -1, *rest).transpose(0, 1).reshape(-1, *rest).contiguous()


def _pad_rows(t: torch.Tensor, s: Shapes) -> torch.Tensor:
    extra = s.padded_vocab_size - t.shape[0]
    if extra < 0:
        raise ValueError(f"vocab {t.shape[0]} rows exceed padded_vocab_size {s.padded_vocab_size}")
    return torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) if extra else t


def _drop_padding(t: torch.Tensor, s: Shapes) -> torch.Tensor:
    if t.shape[0] < s.vocab_size:
        raise ValueError(f"word embeddings have {t.shape[0]} rows, fewer than the tokenizer's "
                         f"{s.vocab_size} tokens: the checkpoint and the tokenizer do not belong together")
    return t[: s.vocab_size]


Transform = Callable[[torch.Tensor, Shapes], torch.Tensor]
# op → (Megatron → HF, HF → Megatron). Conv1D in HF stores [in, out], hence the transposes.
TRANSFORMS: dict[str, tuple[Transform, Transform]] = {
    "copy": (lambda t, s: t, lambda t, s: t),
    "transpose": (lambda t, s: t.t().contiguous(), lambda t, s: t.t().contiguous()),
    "qkv_weight": (lambda t, s: _qkv_to_hf(t, s).t().contiguous(), lambda t, s: _qkv_from_hf(t.t(), s)),
    "qkv_bias": (_qkv_to_hf, _qkv_from_hf),
    "vocab": (_drop_padding, _pad_rows),
}


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")


_BY_MEGATRON = [(_pattern(r.megatron), r) for r in RULES]
_BY_HF = [(_pattern(r.hf), r) for r in RULES if r.hf]
_BY_MCORE = [(_pattern(r.mcore), r) for r in RULES]


def match(name: str, hf: bool = False) -> tuple[Rule, int | None] | None:
    """The rule for a flat name (Megatron by default, HF with ``hf=True``) and its layer index, or None."""
    for pattern, rule in _BY_HF if hf else _BY_MEGATRON:
        m = pattern.match(name)
        if m:
            return rule, int(m.group("i")) if "i" in m.groupdict() else None
    return None


def normalize(name: str) -> str | None:
    """A Megatron name in Slipway's spelling, or None for bookkeeping entries that carry no weights."""
    if name.endswith(IGNORED_SUFFIXES):
        return None
    for old, new in ALIASES:
        name = name.replace(old, new)
    return name


def from_mcore(name: str, untied: bool = False) -> str | None:
    """A Megatron-core name in Slipway's (legacy) spelling; None for bookkeeping (``_extra_state``) and
    for names the table does not know (the caller reports those). mcore calls both the tied head's
    last-stage copy and an untied head ``output_layer.weight``: ``untied`` (the checkpoint's
    args.untie_embeddings_and_output_weights) says which."""
    if name.endswith(IGNORED_SUFFIXES):
        return None
    for old, new in MCORE_ALIASES:
        name = name.replace(old, new)
    if name == MCORE_HEAD:
        return OUTPUT_LAYER if untied else HEAD_EMBEDDINGS
    for pattern, rule in _BY_MCORE:
        m = pattern.match(name)
        if m:
            return rule.megatron.format(i=m.group("i")) if "i" in m.groupdict() else rule.megatron
    return None


def to_dist(mcore_name: str) -> tuple[str, int | None]:
    """A Megatron-core flat name → (its key in a torch_dist checkpoint, its layer number or None): the
    layers are stacked into one ``decoder.layers.X`` tensor and the norms take the Transformer-Engine-style
    names (:data:`MCORE_ALIASES` read backwards), as Megatron-core's ``sharded_state_dict`` names them."""
    if not mcore_name.startswith(MCORE_LAYERS):
        return mcore_name, None
    i, rest = mcore_name[len(MCORE_LAYERS):].split(".", 1)
    rest = "." + rest
    for te_style, own in MCORE_ALIASES:
        rest = rest.replace(own, te_style)
    return MCORE_LAYERS + rest[1:], int(i)


def to_mcore(name: str) -> str:
    """Slipway's (legacy) flat name in Megatron-core's spelling (the inverse of :func:`from_mcore`)."""
    if name == HEAD_EMBEDDINGS:
        return MCORE_HEAD
    found = match(name)
    if found is None:
        raise KeyError(f"no Megatron-core name for {name!r}")
    rule, i = found
    return rule.mcore.format(i=i)


def megatron_to_hf(state: dict[str, torch.Tensor], shapes: Shapes) -> dict[str, torch.Tensor]:
    """Full Megatron state (flat names, global layers, padded vocab) → HF GPT2LMHeadModel state."""
    out = {}
    for name, tensor in state.items():
        found = match(name)
        if found is None:
            raise KeyError(f"no HF name for Megatron parameter {name!r}")
        rule, i = found
        out[rule.hf.format(i=i)] = TRANSFORMS[rule.op][0](tensor, shapes)
    return out


def hf_tensor(hf_name: str, state: dict[str, torch.Tensor], shapes: Shapes) -> torch.Tensor:
    """One HF tensor made from the full Megatron ``state`` (to convert and write one tensor at a time)."""
    found = match(hf_name, hf=True)
    if found is None:
        raise KeyError(f"{hf_name!r} is not a GPT2LMHeadModel parameter Slipway knows")
    rule, i = found
    return TRANSFORMS[rule.op][0](state[rule.megatron.format(i=i)], shapes)


def hf_to_megatron(state: dict[str, torch.Tensor], shapes: Shapes) -> dict[str, torch.Tensor]:
    """HF GPT2LMHeadModel state → full Megatron state; ``lm_head.weight`` must be tied to ``wte``."""
    out = {}
    for name, tensor in state.items():
        if name == "lm_head.weight" or name.endswith(IGNORED_SUFFIXES):
            continue
        found = match(name, hf=True)
        if found is None:
            raise KeyError(f"{name!r} is not a GPT2LMHeadModel parameter Slipway knows")
        rule, i = found
        out[rule.megatron.format(i=i)] = TRANSFORMS[rule.op][1](tensor, shapes)
    return out


def features(args: object) -> frozenset[str]:
    """The table's features (Rule.only) of a model, from its checkpoint args (Megatron's names; GPT-2
    defaults where absent)."""
    from trainer.checkpoint.files import arg

    found = set()
    if arg(args, "position_embedding_type", "learned_absolute") == "learned_absolute":
        found.add(LEARNED_POSITIONS)
    if arg(args, "normalization", "LayerNorm") == "LayerNorm":
        found.add(LAYERNORM_BIAS)
    if arg(args, "add_bias_linear", True):
        found.add(LINEAR_BIAS)
    if arg(args, "untie_embeddings_and_output_weights", False):
        found.add(UNTIED)
    return frozenset(found)


def expected_megatron_names(num_layers: int, model_features: frozenset[str] = GPT2_FEATURES) -> list[str]:
    """Every Megatron name a complete model with ``model_features`` has, in table order."""
    names = []
    for rule in RULES:
        if rule.only and rule.only not in model_features:
            continue
        if rule.stage == LAYER:
            names += [rule.megatron.format(i=i) for i in range(num_layers)]
        else:
            names.append(rule.megatron)
    return names
