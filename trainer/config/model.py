"""The ``model`` and ``parallel`` sections (torch-free): the GPT's shape and how it is split.

``ModelConfig`` is also the GPT's own configuration (``trainer.model.GPTConfig`` is this class): the
model is built from the section itself once ``trainer.main`` has filled ``vocab_size`` from the
tokenizer, so no second copy of the shape can disagree with the one users set.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.checks import ConfigIssue, Section, choice, issue, positive
from trainer.formulas import padded_vocab_size

ATTENTION_BACKENDS = ("sdpa", "softmax")
SCHEDULES = ("1f1b", "afab")


@dataclass
class ModelConfig(Section):
    """GPT shape and regularisation (Megatron's names; Megatron GPT == HF GPT-2 math, formats.md §4)."""

    num_layers: int = 12
    """Transformer blocks; parallel.pp_size must divide it (CodeParrot-small: 12)."""
    hidden_size: int = 768
    """Width h of the residual stream; a multiple of num_attention_heads (CodeParrot-small: 768)."""
    num_attention_heads: int = 12
    """Attention heads per layer (head_dim = hidden_size / heads); parallel.tp_size must divide it."""
    seq_length: int = 1024
    """Tokens per training sequence."""
    max_position_embeddings: int | None = None
    """Rows of the learned position embedding; at least seq_length; null: seq_length."""
    vocab_size: int | None = None
    """The tokenizer's vocabulary size (unpadded; the embedding is padded to a multiple of
    make_vocab_size_divisible_by × tp_size); null: read from tokenizer.vocab_file."""
    ffn_hidden_size: int | None = None
    """MLP inner width; null: 4 × hidden_size."""
    hidden_dropout: float = 0.1
    """Dropout probability on the embeddings and the residual branches (attention and MLP outputs)."""
    attention_dropout: float = 0.1
    """Dropout probability on the attention weights."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation (output projections are scaled by
    1/sqrt(2·num_layers), as in Megatron)."""
    layernorm_epsilon: float = 1.0e-5
    """LayerNorm epsilon (GPT-2 / Megatron: 1e-5)."""
    make_vocab_size_divisible_by: int = 128
    """Vocabulary padding unit, multiplied by parallel.tp_size (Megatron's --make-vocab-size-divisible-by)."""
    attention_backend: str = "sdpa"
    """sdpa: torch scaled_dot_product_attention (flash/efficient on GPU); softmax: explicit QK^T → the
    scaled causal softmax kernel → dropout → ·V (Megatron's fused scale-mask-softmax path)."""

    def _normalise(self) -> None:
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.ffn_hidden_size is None and isinstance(self.hidden_size, int):
            self.ffn_hidden_size = 4 * self.hidden_size

    def problems(self) -> list[ConfigIssue]:
        out: list[ConfigIssue] = []
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                     "max_position_embeddings", "make_vocab_size_divisible_by"):
            out += positive(f"model.{name}", getattr(self, name))
        for name in ("vocab_size", "ffn_hidden_size"):
            out += positive(f"model.{name}", getattr(self, name), allow_none=True)
        if out:
            return out  # the rules below divide and compare these sizes
        if self.hidden_size % self.num_attention_heads:
            out.append(issue("hidden_heads", "model.hidden_size", self.hidden_size,
                             f"not divisible by model.num_attention_heads={self.num_attention_heads}",
                             "make hidden_size a multiple of num_attention_heads"))
        if self.seq_length > self.max_position_embeddings:
            out.append(issue("seq_positions", "model.seq_length", self.seq_length,
                             f"exceeds model.max_position_embeddings={self.max_position_embeddings}",
                             f"lower seq_length or set model.max_position_embeddings>={self.seq_length}"))
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                out.append(issue("range", f"model.{name}", getattr(self, name), "must be a probability in "
                                 "[0, 1)", f"set model.{name}=0.1"))
        out += positive("model.init_std", self.init_std) + positive("model.layernorm_epsilon",
                                                                     self.layernorm_epsilon)
        return out + choice("model.attention_backend", self.attention_backend, ATTENTION_BACKENDS)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tp_size: int = 1) -> int:
        """Embedding rows for a tensor-parallel size (Megatron's rule, :func:`trainer.formulas`)."""
        if self.vocab_size is None:
            raise ValueError("model.vocab_size is not resolved: set it, or set tokenizer.vocab_file "
                             "(trainer.main reads the size from it)")
        return padded_vocab_size(self.vocab_size, tp_size, self.make_vocab_size_divisible_by)


@dataclass
class ParallelConfig(Section):
    """Tensor/pipeline layout; data parallelism is whatever the world size leaves (world / (tp·pp))."""

    tp_size: int = 1
    """Tensor-parallel ranks per layer (keep them inside one node: they all-reduce in every layer)."""
    pp_size: int = 1
    """Pipeline stages (model.num_layers must divide evenly)."""
    virtual_pp_size: int = 1
    """Model chunks per pipeline stage for the interleaved 1F1B schedule (Megatron's
    virtual_pipeline_model_parallel_size = num_layers / (pp_size · --num-layers-per-virtual-pipeline-stage)):
    stage r holds chunks r, r+p, r+2p, … of num_layers / (pp_size·v) layers each, which divides the
    pipeline bubble by v for v times the point-to-point traffic (Narayanan et al. 2021, §2.2.2).
    1: no interleaving. v > 1 needs pp_size > 1, num_layers divisible by pp_size·v and the micro-batches
    per step a multiple of pp_size."""
    sequence_parallel: bool = False
    """Shard the LayerNorm/dropout regions along the sequence across the tensor-parallel group (saves
    activation memory, same math; needs tp_size > 1 and seq_length divisible by it)."""
    schedule: str = "1f1b"
    """Pipeline schedule: 1f1b (one forward, one backward; less activation memory) or afab (all forward,
    then all backward)."""
    bucket_size_mb: float = 25.0
    """Data-parallel gradient all-reduce bucket size (MiB of gradients)."""
    overlap_grad_reduce: bool = True
    """Launch each bucket's all-reduce from backward hooks as soon as its gradients are final."""

    def problems(self) -> list[ConfigIssue]:
        out = (positive("parallel.tp_size", self.tp_size) + positive("parallel.pp_size", self.pp_size)
               + positive("parallel.virtual_pp_size", self.virtual_pp_size)
               + choice("parallel.schedule", self.schedule, SCHEDULES)
               + positive("parallel.bucket_size_mb", self.bucket_size_mb))
        if not out and self.virtual_pp_size > 1 and self.pp_size < 2:
            # Megatron (initialize_model_parallel): "pipeline-model-parallel size should be greater than 1
            # with interleaved schedule" — with one stage there is no bubble to shrink.
            out.append(issue("virtual_pp", "parallel.virtual_pp_size", self.virtual_pp_size,
                             f"interleaving needs several pipeline stages; parallel.pp_size={self.pp_size}",
                             "set parallel.virtual_pp_size=1, or parallel.pp_size>=2"))
        return out
