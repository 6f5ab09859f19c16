"""The GPT: single-device code, Megatron GPT / HF GPT-2 math, Megatron legacy parameter names, and the
Llama-family options of the same model (rotary positions, RMSNorm, SwiGLU, grouped-query attention, no
linear biases, an untied head; Megatron's flags and HF LlamaForCausalLM's math).

Activations inside the stack are ``[s, b, h]`` (sequence first, as Megatron) so that sequence parallelism
shards a contiguous leading dimension. Parameter names mirror Megatron's legacy checkpoint
(formats.md §4; :mod:`trainer.model.names` nests them):

    embedding.word_embeddings.weight            [padded_vocab, h]
    embedding.position_embeddings.weight        [max_pos, h]
    encoder.layers.{i}.input_layernorm.{weight,bias}
    encoder.layers.{i}.self_attention.query_key_value.{weight [(np + 2·ng)·d, h], bias}
        rows per KV group: [np/ng query heads, k, v] × d (Megatron's GQA layout; MHA: per head [q, k, v])
    encoder.layers.{i}.self_attention.dense.{weight [h, h], bias}
    encoder.layers.{i}.post_attention_layernorm.{weight,bias}
    encoder.layers.{i}.mlp.dense_h_to_4h.{weight [4h, h], bias}   SwiGLU: [2·ffn, h], rows [gate; up]
    encoder.layers.{i}.mlp.dense_4h_to_h.{weight [h, 4h], bias}
    encoder.final_layernorm.{weight,bias}
    word_embeddings_for_head.weight             tied head, only on a last pipeline stage without the embedding
    output_layer.weight                         untied head [padded_vocab, h], on the last stage

RMSNorm layers have no bias; ``add_bias_linear=false`` drops every linear bias; rope drops the position
table. Norms, rotary and the SwiGLU go through the kernel set (``trainer.ops``).

``i`` is the *local* index within a pipeline stage, as in Megatron's checkpoints; ``layer_offset`` gives
the global index. Parallelism is applied from outside (trainer.parallel): tensor parallelism swaps the
Linear/Embedding/LMHead modules and the ``sequence_scatter`` and ``*_dropout_rng`` hooks; pipeline
parallelism builds a :class:`StageSpec` slice. This module never imports torch.distributed.

Linear layers return ``(x·Wᵀ, bias)`` without adding the bias (skip_bias_add, trainer.model.layers).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trainer.config.model import ModelConfig
from trainer.model.attention import sdpa_context
from trainer.model.layers import EmbeddingTable, Linear, RotaryTable, autocast_dtype, make_norm
from trainer.model.names import renumber
from trainer.model.recompute import Recompute, recomputed
from trainer.ops import KernelSet, reference_set, resolve

Tensor = torch.Tensor


@dataclass(frozen=True)
class StageSpec:
    """Which part of the GPT one pipeline stage builds (the whole model by default)."""

    layer_start: int
    """Global index of this stage's first transformer layer."""
    layer_end: int
    """One past the global index of its last layer."""
    pre_process: bool = True
    """Holds the embedding (first stage)."""
    post_process: bool = True
    """Holds the final LayerNorm, the LM head and the loss (last stage)."""

    def __post_init__(self) -> None:
        if not 0 <= self.layer_start <= self.layer_end:
            raise ValueError(f"StageSpec layers [{self.layer_start}, {self.layer_end}) is not a valid range")


class LMHead(nn.Module):
    """Logits against the tied word embeddings, and the per-token loss over the *true* vocabulary.

    Padded vocabulary columns are excluded from the softmax (Megatron lets them in); their rows are zero
    and never trained, so the loss is independent of the TP-dependent padding and equals the loss of the
    converted Hugging Face model, which has no padded rows. The loss is the kernel set's cross_entropy.
    """

    def __init__(self, vocab_size: int, kernels: KernelSet) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.kernels = kernels

    def forward(self, x: Tensor, weight: Tensor, labels: Tensor | None = None) -> Tensor:
        """x [s, b, h] → logits [b, s, padded_vocab]; with labels [b, s] → per-token loss [b, s] (fp32)."""
        logits = F.linear(x, weight)                           # [s, b, V_pad]
        if labels is None:
            return logits.transpose(0, 1)
        # Loss in [s, b] order over the true vocabulary: the kernel leaves the padded columns out itself
        # (a slice here would zero-fill a [tokens, V] gradient in backward).
        losses = self.kernels.cross_entropy(logits, labels.t().contiguous(), vocab_size=self.vocab_size)
        return losses.t()                                      # [b, s]


class SelfAttention(nn.Module):
    """Causal attention with a fused QKV projection; grouped-query when num_query_groups < heads.

    QKV rows are Megatron's per-group layout [ng, (np/ng) q heads + k + v, d], so TP splits whole KV
    groups with their query heads by a plain row split. Query head j attends with KV group j // (np/ng)
    (Megatron's and HF's repeat of K/V); rope rotates q and k per head after the split.
    """

    def __init__(self, cfg: ModelConfig, kernels: KernelSet) -> None:
        super().__init__()
        heads, groups, d = cfg.num_attention_heads, cfg.query_groups, cfg.head_dim
        self.query_key_value = Linear(cfg.hidden_size, (heads + 2 * groups) * d, cfg.add_bias_linear)
        self.dense = Linear(heads * d, cfg.hidden_size, cfg.add_bias_linear)
        self.head_dim, self.heads_per_group = d, heads // groups
        self.rotary = RotaryTable(cfg.rotary_dim, cfg.rotary_base) if cfg.rotary_dim else None
        self.dropout_p = cfg.attention_dropout
        self.backend, self.sdpa_backend = cfg.attention_backend, cfg.sdpa_backend
        self.kernels = kernels
        # Attention probabilities are sharded by head under TP, so TP sets this to the RNG tracker's fork.
        self.dropout_rng = contextlib.nullcontext
        # Selective recomputation (trainer.model.recompute.apply) and the extra RNG states it restores.
        self.recompute, self.recompute_rng = False, None

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        qkv, qkv_bias = self.query_key_value(x)                # [s, b, (np + 2ng)·d / tp]
        s, b, _ = qkv.shape  # not x's: under sequence parallelism x holds s/tp positions
        if qkv_bias is not None:  # in the activations' dtype: an fp32 bias (autocast) must not promote
            qkv = qkv + qkv_bias.to(qkv.dtype)
        npg = self.heads_per_group
        qkv = qkv.view(s, b, -1, npg + 2, self.head_dim)       # [s, b, groups_local, npg + 2, d]
        # One split, not a slice and two selects: split's backward is a single cat into the QKV
        # gradient, where slice/select backwards would each zero-fill a full-size copy and add them.
        q, k, v = qkv.split([npg, 1, 1], dim=3)
        q = q.permute(1, 2, 3, 0, 4).flatten(1, 2)             # [b, heads_local, s, d]
        k, v = (t.squeeze(3).permute(1, 2, 0, 3) for t in (k, v))  # [b, groups_local, s, d]
        if self.rotary is not None:
            cos, sin = self.rotary(s, x.device)
            q, k = self.kernels.rotary(q, cos, sin), self.kernels.rotary(k, cos, sin)
        if npg > 1:
            k, v = k.repeat_interleave(npg, dim=1), v.repeat_interleave(npg, dim=1)
        if self.recompute:  # selective recomputation: keep q, k, v only
            ctx = recomputed(self.core_attention, q, k, v, rng=self.recompute_rng)
        else:
            ctx = self.core_attention(q, k, v)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, -1)        # [s, b, np·d / tp]
        return self.dense(ctx)                                 # ([s, b, h], bias)

    def core_attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """softmax(q·kᵀ·scale, causal) → dropout → ·v; each [b, heads_local, s, d]."""
        p = self.dropout_p if self.training else 0.0
        scale = self.head_dim ** -0.5
        with self.dropout_rng():
            if self.backend == "sdpa":
                with sdpa_context(self.sdpa_backend, q.device.type):
                    return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, scale=scale)
            probs = self.kernels.scaled_causal_softmax(q @ k.transpose(-2, -1), scale)  # [b, n, s, s]
            return F.dropout(probs, p=p, training=self.training) @ v


class MLP(nn.Module):
    """h → ffn → GeLU(tanh) → h, or SwiGLU: h → [gate; up] (2·ffn rows) → SiLU(gate)·up → h."""

    def __init__(self, cfg: ModelConfig, kernels: KernelSet) -> None:
        super().__init__()
        self.swiglu = cfg.activation == "swiglu"
        width = 2 * cfg.ffn_hidden_size if self.swiglu else cfg.ffn_hidden_size
        self.dense_h_to_4h = Linear(cfg.hidden_size, width, cfg.add_bias_linear)
        self.dense_4h_to_h = Linear(cfg.ffn_hidden_size, cfg.hidden_size, cfg.add_bias_linear)
        self.kernels = kernels

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        y, bias = self.dense_h_to_4h(x)                        # [s, b, (2·)ffn_local]
        if self.swiglu:  # each TP rank holds matching [gate_r; up_r] rows (sharding.GLU)
            return self.dense_4h_to_h(self.kernels.swiglu(y if bias is None else y + bias))
        if bias is None:
            bias = y.new_zeros(y.shape[-1])
        return self.dense_4h_to_h(self.kernels.bias_gelu(y, bias))  # ([s, b, h], bias)


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x))).

    With ``kernels.compile_layers`` (kernels=compile_layer) the block runs the reference ops inside one
    ``torch.compile`` region, shared by every layer (one graph: parameters are its inputs; static shapes,
    so evaluation and a new micro-batch size compile once more each)."""

    def __init__(self, cfg: ModelConfig, kernels: KernelSet) -> None:
        super().__init__()
        self.compiled = kernels.compile_layers
        if self.compiled:
            kernels = reference_set()
        norm = (cfg.normalization, cfg.hidden_size, cfg.norm_epsilon, kernels)
        self.input_layernorm = make_norm(*norm)
        self.self_attention = SelfAttention(cfg, kernels)
        self.post_attention_layernorm = make_norm(*norm)
        self.mlp = MLP(cfg, kernels)
        self.dropout_p = cfg.hidden_dropout
        self.kernels = kernels
        # Replicated residual stream: default RNG. Sequence parallelism shards it: TP sets the fork.
        self.dropout_rng = contextlib.nullcontext

    def forward(self, x: Tensor) -> Tensor:                    # x: [s, b, h] (s/tp under SP)
        return compiled_layer()(self, x) if self.compiled else self.block(x)

    def block(self, x: Tensor) -> Tensor:
        bda = self.kernels.bias_dropout_add
        out, bias = self.self_attention(self.input_layernorm(x))
        with self.dropout_rng():
            x = bda(out, bias, x, self.dropout_p, self.training)
        out, bias = self.mlp(self.post_attention_layernorm(x))
        with self.dropout_rng():
            x = bda(out, bias, x, self.dropout_p, self.training)
        return x


@functools.cache
def compiled_layer():
    """``TransformerLayer.block`` under torch.compile, one for every layer of every model (dynamo guards on
    the layer's structure, not its identity: the layers share one graph)."""
    return torch.compile(TransformerLayer.block, dynamic=False)


class Embedding(nn.Module):
    """Word (+ learned position, unless rope) embeddings → [s, b, h], then dropout."""

    def __init__(self, cfg: ModelConfig, padded_vocab_size: int) -> None:
        super().__init__()
        self.word_embeddings = EmbeddingTable(padded_vocab_size, cfg.hidden_size)
        if cfg.position_embedding == "learned":
            self.position_embeddings = EmbeddingTable(cfg.max_position_embeddings, cfg.hidden_size)
        self.sequence_scatter = nn.Identity()  # sequence parallelism: keep this rank's sequence chunk
        self.dropout_p = cfg.hidden_dropout
        self.dropout_rng = contextlib.nullcontext

    def forward(self, tokens: Tensor) -> Tensor:
        # Under autocast the rows come out in the compute dtype (the tables are cast, not the gathered
        # rows): the residual stream starts, and stays, in bf16/fp16 (trainer/optim/precision.py).
        dtype = autocast_dtype(tokens.device)
        x = self.word_embeddings(tokens, dtype)                                 # [b, s, h]
        if hasattr(self, "position_embeddings"):
            x = x + self.position_embeddings(torch.arange(tokens.shape[1], device=tokens.device), dtype)
        x = self.sequence_scatter(x.transpose(0, 1).contiguous())               # [s, b, h]
        with self.dropout_rng():
            return F.dropout(x, p=self.dropout_p, training=self.training)


class Encoder(nn.Module):
    """This stage's transformer layers (local indices) and, on the last stage, the final LayerNorm."""

    def __init__(self, cfg: ModelConfig, stage: StageSpec, kernels: KernelSet) -> None:
        super().__init__()
        self.layer_offset = stage.layer_start
        self.layers = nn.ModuleList(TransformerLayer(cfg, kernels)
                                    for _ in range(stage.layer_start, stage.layer_end))
        if stage.post_process:
            self.final_layernorm = make_norm(cfg.normalization, cfg.hidden_size, cfg.norm_epsilon, kernels)
        self.recompute, self.recompute_rng = Recompute(), None  # full recomputation: set by apply()

    def forward(self, x: Tensor) -> Tensor:
        for start, end, again in self.recompute.groups(len(self.layers)):
            run = functools.partial(_run_layers, self.layers[start:end])
            x = recomputed(run, x, rng=self.recompute_rng) if again else run(x)
        return self.final_layernorm(x) if hasattr(self, "final_layernorm") else x


def _run_layers(layers: nn.ModuleList, x: Tensor) -> Tensor:
    for layer in layers:
        x = layer(x)
    return x


class GPT(nn.Module):
    """A GPT, or one pipeline stage of it.

    Build on any device, then call :func:`trainer.model.init.init_weights` (or use :func:`build_gpt`).
    ``forward`` takes tokens [b, s] on the first stage, the previous stage's hidden [s, b, h] otherwise;
    returns the hidden [s, b, h] on non-last stages, and on the last stage logits [b, s, V_pad(/tp)] or,
    with ``labels``, the per-token loss [b, s] (reduce it with :func:`masked_mean`).
    """

    def __init__(self, cfg: ModelConfig, stage: StageSpec | None = None,
                 padded_vocab_size: int | None = None, kernels: KernelSet | str = "auto") -> None:
        super().__init__()
        self.cfg = cfg
        self.stage = stage or StageSpec(0, cfg.num_layers)
        if self.stage.layer_end > cfg.num_layers:
            raise ValueError(f"stage layers up to {self.stage.layer_end} > model.num_layers={cfg.num_layers}")
        self.padded_vocab_size = padded_vocab_size or cfg.padded_vocab_size(1)
        if self.padded_vocab_size < cfg.vocab_size:  # padded_vocab_size(1) has checked it is set
            raise ValueError(f"padded_vocab_size={self.padded_vocab_size} < vocab_size={cfg.vocab_size}")
        kernels = resolve(kernels) if isinstance(kernels, str) else kernels  # the top-level `kernels` key
        if self.stage.pre_process:
            self.embedding = Embedding(cfg, self.padded_vocab_size)
        self.encoder = Encoder(cfg, self.stage, kernels)
        if self.stage.post_process:
            if not cfg.tie_word_embeddings:  # Megatron's output_layer (--untie-embeddings-and-output-weights)
                self.output_layer = EmbeddingTable(self.padded_vocab_size, cfg.hidden_size)
            elif not self.stage.pre_process:  # the tied head's own copy; kept equal by a grad all-reduce
                self.word_embeddings_for_head = EmbeddingTable(self.padded_vocab_size, cfg.hidden_size)
            self.lm_head = LMHead(cfg.vocab_size, kernels)

    def head_weight(self) -> Tensor:
        """The LM head's weight: the untied output layer, the word embeddings (tied), or this last
        stage's copy of them."""
        if not self.cfg.tie_word_embeddings:
            return self.output_layer.weight
        if self.stage.pre_process:
            return self.embedding.word_embeddings.weight
        return self.word_embeddings_for_head.weight

    def forward(self, tokens: Tensor | None = None, hidden: Tensor | None = None,
                labels: Tensor | None = None) -> Tensor:
        x = self.embedding(tokens) if self.stage.pre_process else hidden   # [s, b, h]
        if x is None:
            raise ValueError("a non-first pipeline stage needs `hidden` (the previous stage's output)")
        x = self.encoder(x)
        if not self.stage.post_process:
            return x
        return self.lm_head(x, self.head_weight(), labels)

    def global_name(self, local_name: str) -> str:
        """Parameter name with the layer index made global (``encoder.layers.{i+offset}...``)."""
        return renumber(local_name, self.encoder.layer_offset)


def masked_mean(losses: Tensor, loss_mask: Tensor | None = None) -> Tensor:
    """Mean of per-token losses over the positions where loss_mask is 1 (all positions if None)."""
    if loss_mask is None:
        return losses.mean()
    mask = loss_mask.to(losses.dtype)
    return (losses * mask).sum() / mask.sum().clamp(min=1.0)


def build_gpt(cfg: ModelConfig, seed: int, device: torch.device | str = "cpu", kernels: str = "auto") -> GPT:
    """A whole single-device GPT with the layout-independent initialisation for ``seed``."""
    from trainer.model.init import init_weights, materialize

    kernel_set = resolve(kernels, torch.device(device).type)  # outside the meta-device context
    with torch.device("meta"):
        model = GPT(cfg, kernels=kernel_set)
    materialize(model, device)
    init_weights(model, seed)
    return model
