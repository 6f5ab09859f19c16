"""The GPT's configuration: one small dataclass (the ``model`` config section) plus the vocab padding rule."""

from __future__ import annotations

from dataclasses import dataclass

ATTENTION_BACKENDS = ("sdpa", "softmax")


@dataclass(frozen=True)
class GPTConfig:
    """Shape and regularisation of the GPT (Megatron GPT == HF GPT-2 math; see formats.md §4).

    Field names are the ``model.*`` config keys users rely on; ``kernels`` is the top-level config key.
    """

    num_layers: int
    """Transformer blocks (CodeParrot-small: 12)."""
    hidden_size: int
    """Width h of the residual stream (CodeParrot-small: 768)."""
    num_attention_heads: int
    """Heads; head_dim = hidden_size / num_attention_heads."""
    seq_length: int
    """Training sequence length s."""
    vocab_size: int
    """The tokenizer's vocabulary size (unpadded); the embedding is padded, see :func:`padded_vocab_size`."""
    max_position_embeddings: int | None = None
    """Rows of the learned position table; defaults to ``seq_length``."""
    hidden_dropout: float = 0.1
    """Dropout on embeddings and on each residual branch (Megatron --hidden-dropout)."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities (Megatron --attention-dropout)."""
    init_std: float = 0.02
    """Std of N(0, std) weight init; output projections use std / sqrt(2 · num_layers)."""
    ffn_hidden_size: int | None = None
    """MLP inner width; defaults to 4 · hidden_size."""
    layernorm_epsilon: float = 1e-5
    """LayerNorm eps (GPT-2 / Megatron: 1e-5)."""
    make_vocab_size_divisible_by: int = 128
    """Vocab padding unit, multiplied by tp_size (Megatron --make-vocab-size-divisible-by)."""
    kernels: str = "auto"
    """Kernel set for trainer.ops.resolve (eager | csrc | apex | compile | auto)."""
    attention_backend: str = "sdpa"
    """'sdpa': torch scaled_dot_product_attention (flash/efficient on GPU); 'softmax': explicit
    QK^T → kernels.scaled_causal_softmax → dropout → ·V (Megatron's fused scale-mask-softmax path)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}={getattr(self, name)} must be >= 1")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"model.hidden_size={self.hidden_size} is not divisible by "
                             f"model.num_attention_heads={self.num_attention_heads}; pick a head count "
                             "that divides the hidden size")
        if self.max_position_embeddings is None:
            object.__setattr__(self, "max_position_embeddings", self.seq_length)
        if self.max_position_embeddings < self.seq_length:
            raise ValueError(f"model.max_position_embeddings={self.max_position_embeddings} < "
                             f"model.seq_length={self.seq_length}: positions beyond the table cannot be "
                             "embedded; raise max_position_embeddings")
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"model.{name}={getattr(self, name)} must be in [0, 1)")
        if self.init_std <= 0:
            raise ValueError(f"model.init_std={self.init_std} must be > 0")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"model.attention_backend={self.attention_backend!r} is not one of "
                             f"{ATTENTION_BACKENDS}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tp_size: int = 1) -> int:
        """Embedding rows for a tensor-parallel size (see :func:`padded_vocab_size`)."""
        return padded_vocab_size(self.vocab_size, tp_size, self.make_vocab_size_divisible_by)


def padded_vocab_size(vocab_size: int, tp_size: int = 1, divisible_by: int = 128) -> int:
    """Megatron's rule: round the vocab up to a multiple of ``divisible_by · tp_size``.

    32768 stays 32768 (tp ≤ 256); GPT-2's 50257 becomes 50304. The padded rows are zero and their
    logits are excluded from the loss (see trainer.model.gpt), so the padding never changes the math.
    """
    unit = divisible_by * tp_size
    return -(-vocab_size // unit) * unit
