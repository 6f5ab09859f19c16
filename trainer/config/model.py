"""The ``model`` and ``parallel`` sections (torch-free): the GPT's shape and how it is split.

``ModelConfig`` is also the GPT's own configuration (trainer.model builds from this class): the
model is built from the section itself once ``trainer.run`` has filled ``vocab_size`` from the
tokenizer, so no second copy of the shape can disagree with the one users set.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config_issues import ConfigIssue, Section, choice, issue, positive
from trainer.formulas import PipelineSplit, padded_vocab_size

ATTENTION_BACKENDS = ("sdpa", "softmax")
SDPA_BACKENDS = ("auto", "cudnn", "flash", "efficient", "math")
POSITION_EMBEDDINGS = ("learned", "rope")
NORMALIZATIONS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "swiglu")
# Our values → Megatron's (args.position_embedding_type, args.normalization); readers invert these.
MEGATRON_POSITION = {"learned": "learned_absolute", "rope": "rope"}
MEGATRON_NORMALIZATION = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}
SCHEDULES = ("1f1b", "afab")


@dataclass
class ModelConfig(Section):
    """GPT shape and regularisation (Megatron's names; Megatron GPT == HF GPT-2 math, formats.md §4)."""

    num_layers: int = 12
    """Transformer blocks; parallel.pp_size must divide it, or split it unevenly with
    parallel.first_stage_layers / last_stage_layers (CodeParrot-small: 12)."""
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
    """MLP inner width; null: 4 × hidden_size, or with activation=swiglu Megatron's
    int(4·hidden_size·2/3 / 64)·64 (the gated MLP's three matrices then hold about what GeLU's two do)."""
    hidden_dropout: float = 0.1
    """Dropout probability on the embeddings and the residual branches (attention and MLP outputs)."""
    attention_dropout: float = 0.1
    """Dropout probability on the attention weights: a recipe choice. 0.1 is GPT-2's and Megatron's
    default; on Hopper it keeps SDPA off cuDNN attention (which refuses dropout) on flash, about twice the
    attention time (../shared/design/performance.md); 0 is what llm.c and nanoGPT-style runs use."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation (output projections are scaled by
    1/sqrt(2·num_layers), as in Megatron)."""
    norm_epsilon: float = 1.0e-5
    """Epsilon of every LayerNorm/RMSNorm (Megatron's --norm-epsilon; GPT-2: 1e-5, Llama 3: 1e-5,
    Llama 2: 1e-6)."""
    position_embedding: str = "learned"
    """learned: absolute position embeddings (GPT-2); rope: rotary embeddings applied to q and k in every
    layer, no position table (Megatron's --position-embedding-type rope; Su et al. 2021)."""
    rotary_base: float = 10000.0
    """Rotary base θ (Megatron's --rotary-base; HF rope_theta): 10000, Llama 3: 500000."""
    rotary_percent: float = 1.0
    """Fraction of each head's dims that rotate (Megatron's --rotary-percent); 1.0 for Llama (HF's
    LlamaForCausalLM has no partial rotary, so to_hf needs 1.0)."""
    normalization: str = "layernorm"
    """layernorm (weight and bias) or rmsnorm (weight only; Megatron's --normalization RMSNorm)."""
    activation: str = "gelu"
    """gelu: h → ffn → GeLU(tanh) → h; swiglu: h → [gate | up] (2 × ffn) → SiLU(gate)·up → h
    (Megatron's --swiglu; Shazeer 2020)."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention (Megatron's --group-query-attention
    --num-query-groups; HF num_key_value_heads); must divide num_attention_heads; 1 is multi-query;
    null: num_attention_heads (multi-head attention). parallel.tp_size must divide it."""
    add_bias_linear: bool = True
    """Biases in every linear layer (false: Megatron's --disable-bias-linear, as Llama)."""
    tie_word_embeddings: bool = True
    """The LM head is the word embedding matrix (GPT-2); false: a separate output layer
    (Megatron's --untie-embeddings-and-output-weights, as Llama)."""
    make_vocab_size_divisible_by: int = 128
    """Vocabulary padding unit, multiplied by parallel.tp_size (Megatron's --make-vocab-size-divisible-by)."""
    attention_backend: str = "sdpa"
    """sdpa: torch scaled_dot_product_attention (the kernel: sdpa_backend); softmax: explicit QK^T → the
    scaled causal softmax kernel → dropout → ·V (Megatron's fused scale-mask-softmax path)."""
    sdpa_backend: str = "auto"
    """The SDPA kernel (attention_backend=sdpa): auto ranks cuDNN > flash > memory-efficient > math on CUDA
    and takes the first that supports the call (cuDNN refuses attention dropout: with attention_dropout > 0
    training runs flash, evaluation cuDNN), and leaves the choice to torch on CPU (its flash kernel without
    dropout, else math); cudnn, flash, efficient or math allow only that kernel (a call it cannot serve
    fails). The job's first log lines name the kernel training and evaluation run."""

    def _normalise(self) -> None:
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.ffn_hidden_size is None and isinstance(self.hidden_size, int):
            four_h = 4 * self.hidden_size  # with --swiglu, Megatron's default (arguments.py) is 2/3 of it
            self.ffn_hidden_size = int(four_h * 2 / 3 / 64) * 64 if self.activation == "swiglu" else four_h
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads

    def problems(self) -> list[ConfigIssue]:
        out: list[ConfigIssue] = []
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                     "max_position_embeddings", "make_vocab_size_divisible_by"):
            out += positive(f"model.{name}", getattr(self, name))
        for name in ("vocab_size", "ffn_hidden_size", "num_query_groups"):
            out += positive(f"model.{name}", getattr(self, name), allow_none=True)
        if out:
            return out  # the rules below divide and compare these sizes
        if self.hidden_size % self.num_attention_heads:
            out.append(issue("hidden_heads", "model.hidden_size", self.hidden_size,
                             f"not divisible by model.num_attention_heads={self.num_attention_heads}",
                             "make hidden_size a multiple of num_attention_heads"))
        if self.num_query_groups and self.num_attention_heads % self.num_query_groups:
            out.append(issue("heads_groups", "model.num_query_groups", self.num_query_groups,
                             f"does not divide model.num_attention_heads={self.num_attention_heads}",
                             "choose a number of query groups that divides the heads (1: multi-query)"))
        rope = self.position_embedding == "rope"
        if rope and (not 0.0 < self.rotary_percent <= 1.0 or int(self.head_dim * self.rotary_percent) % 2):
            out.append(issue("range", "model.rotary_percent", self.rotary_percent,
                             f"must be in (0, 1] and rotate an even number of the {self.head_dim} head dims",
                             "set model.rotary_percent=1.0"))
        if self.seq_length > self.max_position_embeddings:
            out.append(issue("seq_positions", "model.seq_length", self.seq_length,
                             f"exceeds model.max_position_embeddings={self.max_position_embeddings}",
                             f"lower seq_length or set model.max_position_embeddings>={self.seq_length}"))
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                out.append(issue("range", f"model.{name}", getattr(self, name), "must be a probability in "
                                 "[0, 1)", f"set model.{name}=0.1"))
        out += positive("model.init_std", self.init_std) + positive("model.norm_epsilon", self.norm_epsilon)
        out += positive("model.rotary_base", self.rotary_base)
        for key, value, allowed in (("position_embedding", self.position_embedding, POSITION_EMBEDDINGS),
                                    ("normalization", self.normalization, NORMALIZATIONS),
                                    ("activation", self.activation, ACTIVATIONS),
                                    ("attention_backend", self.attention_backend, ATTENTION_BACKENDS),
                                    ("sdpa_backend", self.sdpa_backend, SDPA_BACKENDS)):
            out += choice(f"model.{key}", value, allowed)
        return out

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads (num_query_groups, resolved: the heads without GQA)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that rotate under rope (0 with learned positions)."""
        return int(self.head_dim * self.rotary_percent) if self.position_embedding == "rope" else 0

    def megatron_architecture(self) -> dict:
        """The architecture under Megatron-LM's argument names, for a checkpoint's ``args`` (what
        Megatron's --use-checkpoint-args and Slipway's converters read back)."""
        return {
            "position_embedding_type": MEGATRON_POSITION[self.position_embedding],
            "rotary_base": self.rotary_base, "rotary_percent": self.rotary_percent,
            "normalization": MEGATRON_NORMALIZATION[self.normalization], "norm_epsilon": self.norm_epsilon,
            "swiglu": self.activation == "swiglu", "add_bias_linear": self.add_bias_linear,
            "group_query_attention": self.query_groups != self.num_attention_heads,
            "num_query_groups": self.query_groups,
            "untie_embeddings_and_output_weights": not self.tie_word_embeddings,
        }

    def tp_issues(self, tp_size: int) -> list[ConfigIssue]:
        """What this shape cannot split into ``tp_size`` tensor-parallel ranks (checked at plan time by
        the orchestrator and at build time by trainer.parallel.apply): heads, KV groups, MLP width."""
        out = []
        for key, n in (("num_attention_heads", self.num_attention_heads),
                       ("num_query_groups", self.query_groups), ("ffn_hidden_size", self.ffn_hidden_size)):
            if n and tp_size > 0 and n % tp_size:
                out.append(issue("tp_" + key, "parallel.tp_size", tp_size, f"model.{key}={n} is not "
                                 "divisible by it", f"choose a tp_size that divides model.{key}={n}"))
        return out

    def padded_vocab_size(self, tp_size: int = 1) -> int:
        """Embedding rows for a tensor-parallel size (Megatron's rule, :func:`trainer.formulas`)."""
        if self.vocab_size is None:
            raise ValueError("model.vocab_size is not resolved: set it, or set tokenizer.vocab_file "
                             "(trainer.run reads the size from it)")
        return padded_vocab_size(self.vocab_size, tp_size, self.make_vocab_size_divisible_by)


@dataclass
class ParallelConfig(Section):
    """Tensor/pipeline layout; data parallelism is whatever the world size leaves (world / (tp·pp))."""

    tp_size: int = 1
    """Tensor-parallel ranks per layer (keep them inside one node: they all-reduce in every layer)."""
    pp_size: int = 1
    """Pipeline stages: each holds model.num_layers / pp_size layers, unless first_stage_layers or
    last_stage_layers split them unevenly."""
    first_stage_layers: int | None = None
    """Layers on the first pipeline stage (Megatron's --decoder-first-pipeline-num-layers), which also
    holds the embedding: fewer there balances the stages' memory and time; the stages between share the
    rest equally. null: the even split. Needs pp_size >= 2."""
    last_stage_layers: int | None = None
    """Layers on the last pipeline stage (Megatron's --decoder-last-pipeline-num-layers), which also
    holds the final norm, the LM head and the loss; null: the even split. Needs pp_size >= 2."""
    virtual_pp_size: int = 1
    """Model chunks per pipeline stage for the interleaved 1F1B schedule (Megatron's
    virtual_pipeline_model_parallel_size = num_layers / (pp_size · --num-layers-per-virtual-pipeline-stage)):
    stage r holds chunks r, r+p, r+2p, … of num_layers / (pp_size·v) layers each, which divides the
    pipeline bubble by v for v times the point-to-point traffic (Narayanan et al. 2021, §2.2.2).
    1: no interleaving. v > 1 needs pp_size > 1, each stage's layers divisible by v (num_layers by pp_size·v
    when even) and the micro-batches per step a multiple of pp_size."""
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
               + positive("parallel.first_stage_layers", self.first_stage_layers, allow_none=True)
               + positive("parallel.last_stage_layers", self.last_stage_layers, allow_none=True)
               + choice("parallel.schedule", self.schedule, SCHEDULES)
               + positive("parallel.bucket_size_mb", self.bucket_size_mb))
        uneven = [k for k in ("first_stage_layers", "last_stage_layers") if getattr(self, k) is not None]
        if not out and uneven and self.pp_size < 2:
            out.append(issue("uneven_pp", f"parallel.{uneven[0]}", getattr(self, uneven[0]),
                             "an uneven split needs several pipeline stages; "
                             f"parallel.pp_size={self.pp_size}",
                             f"set parallel.{uneven[0]}=null, or parallel.pp_size>=2"))
        if not out and self.virtual_pp_size > 1 and self.pp_size < 2:
            # Megatron (initialize_model_parallel): "pipeline-model-parallel size should be greater than 1
            # with interleaved schedule" — with one stage there is no bubble to shrink.
            out.append(issue("virtual_pp", "parallel.virtual_pp_size", self.virtual_pp_size,
                             f"interleaving needs several pipeline stages; parallel.pp_size={self.pp_size}",
                             "set parallel.virtual_pp_size=1, or parallel.pp_size>=2"))
        return out

    def split(self, num_layers: int, virtual_pp_size: int | None = None) -> PipelineSplit:
        """How this layout splits ``num_layers`` (unchecked: :meth:`layer_issues` says what is wrong)."""
        v = self.virtual_pp_size if virtual_pp_size is None else virtual_pp_size
        return PipelineSplit(num_layers, self.pp_size, v, self.first_stage_layers, self.last_stage_layers)

    def layer_issues(self, num_layers: int) -> list[ConfigIssue]:
        """Whether the stages and their model chunks get whole shares of ``num_layers`` (Megatron's rule,
        trainer.formulas.PipelineSplit; checked by RunConfig, so at plan time and by the standalone
        trainer before any rank starts; trainer.parallel.apply at build time)."""
        sizes = (num_layers, self.pp_size, self.virtual_pp_size)
        if not all(isinstance(x, int) and x > 0 for x in sizes) or self.problems():
            return []  # the sections' own problems say what is wrong first
        why = self.split(num_layers).problem()
        if why is None:
            return []
        if self.virtual_pp_size > 1 and self.split(num_layers, 1).problem() is None:  # the chunks
            fit = [k for k in range(2, self.virtual_pp_size + 3)
                   if self.split(num_layers, k).problem() is None]
            return [issue("vpp_layers", "parallel.virtual_pp_size", self.virtual_pp_size,
                          f"model.{why}" if why.startswith("num_layers") else why,
                          f"use parallel.virtual_pp_size={fit[0]}" if fit else
                          "use parallel.virtual_pp_size=1, or layers that split into equal chunks")]
        if not self.split(num_layers).uneven:
            return [issue("pp_layers", "parallel.pp_size", self.pp_size,
                          f"model.num_layers={num_layers} is not divisible by it",
                          "choose a pp_size that divides the number of layers, or split them unevenly as "
                          "Megatron does: parallel.first_stage_layers / last_stage_layers")]
        key = "first_stage_layers" if self.first_stage_layers is not None else "last_stage_layers"
        return [issue("pp_layers", f"parallel.{key}", getattr(self, key), why,
                      f"choose first_stage_layers / last_stage_layers that leave the {self.pp_size} stages "
                      f"whole shares of model.num_layers={num_layers}")]
