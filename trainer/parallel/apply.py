"""Applying parallelism to the single-device GPT from outside: the stage split and the TP plan.

``stage_spec`` picks this pipeline stage's layers (first stage: embedding; last: final LN, head, loss),
evenly or by Megatron's uneven split (parallel.first_stage_layers / last_stage_layers).
``apply_tensor_parallel`` swaps modules by the sharding table (``trainer.parallel.sharding``): each
layer Linear whose weight is ``column`` becomes a ColumnParallelLinear, ``row`` a RowParallelLinear; the
``glu`` SwiGLU first matrix a ColumnParallelLinear holding matching gate/up halves; the ``vocab`` word
embeddings (and the last stage's head copy, or the untied output layer) a VocabParallelEmbedding; the head a
VocabParallelLMHead (its cross-entropy never gathers the vocabulary). It also points the dropout RNG
hooks at the tracker's fork where activations are sharded (attention always; embedding and residual
dropout only under sequence parallelism, which also swaps in the sequence scatter after the embedding).
"""

from __future__ import annotations

from torch import nn

from trainer.config.model import ModelConfig, ParallelConfig
from trainer.formulas import PipelineSplit
from trainer.model.gpt import GPT, StageSpec
from trainer.parallel import sharding
from trainer.parallel.random import RNGTracker
from trainer.parallel.state import ParallelState
from trainer.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    ScatterToSequence,
    VocabParallelEmbedding,
    VocabParallelLMHead,
)


def check_compatible(cfg: ModelConfig, pcfg: ParallelConfig) -> None:
    """The model's shape must split under the layout; errors say which field to change."""
    tp = pcfg.tp_size
    # The config's own rules: the stages' layers; heads, KV groups (GQA) and the MLP width.
    for found in pcfg.layer_issues(cfg.num_layers) + cfg.tp_issues(tp):
        raise ValueError(str(found))
    if pcfg.sequence_parallel and cfg.seq_length % tp:
        raise ValueError(f"parallel.sequence_parallel needs model.seq_length={cfg.seq_length} divisible by "
                         f"parallel.tp_size={tp}")


def stage_spec(split: PipelineSplit, pp_rank: int, chunk: int = 0) -> StageSpec:
    """This stage's (chunk's) block of layers (``PipelineSplit.chunk_layers``: num_layers / (pp_size·v),
    or Megatron's uneven split): the model's first chunk (rank 0, chunk 0) holds the embedding, its last
    (rank p−1, chunk v−1) the final LayerNorm, head and loss."""
    layers = split.chunk_layers(pp_rank, chunk)
    return StageSpec(layers.start, layers.stop, pre_process=pp_rank == 0 and chunk == 0,
                     post_process=pp_rank == split.pp_size - 1 and chunk == split.virtual_pp_size - 1)


# The layer's Linear modules; the sharding table says how each one splits.
_LAYER_LINEARS = ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h",
                  "mlp.dense_4h_to_h")
_PARALLEL_LINEAR = {sharding.COLUMN: ColumnParallelLinear, sharding.ROW: RowParallelLinear}


def apply_tensor_parallel(model: GPT, pstate: ParallelState, sequence_parallel: bool,
                          tracker: RNGTracker) -> None:
    """Swap ``model``'s modules for tensor-parallel ones in place (call on the meta device, then init)."""
    if pstate.tp_size == 1:
        return
    cfg, tp, sp = model.cfg, pstate.tp_group, sequence_parallel
    h = cfg.hidden_size
    swiglu = cfg.activation == "swiglu"
    for layer in model.encoder.layers:
        for path in _LAYER_LINEARS:
            owner, attr = layer.get_submodule(path.rpartition(".")[0]), path.rpartition(".")[2]
            out_features, in_features = getattr(owner, attr).weight.shape
            split, bias = sharding.kind(f"encoder.layers.0.{path}.weight", swiglu), cfg.add_bias_linear
            if split == sharding.GLU:
                linear = ColumnParallelLinear(in_features, out_features, tp, sp, bias, glu=True)
            else:
                linear = _PARALLEL_LINEAR[split](in_features, out_features, tp, sp, bias)
            setattr(owner, attr, linear)
        layer.self_attention.dropout_rng = tracker.fork
        if sp:
            layer.dropout_rng = tracker.fork
    if model.stage.pre_process:
        model.embedding.word_embeddings = VocabParallelEmbedding(model.padded_vocab_size, h, tp)
        if sp:
            model.embedding.sequence_scatter = ScatterToSequence(tp)
            model.embedding.dropout_rng = tracker.fork
    if model.stage.post_process:
        if not cfg.tie_word_embeddings:  # the untied head: vocab rows split like the embedding
            model.output_layer = VocabParallelEmbedding(model.padded_vocab_size, h, tp)
        elif not model.stage.pre_process:
            model.word_embeddings_for_head = VocabParallelEmbedding(model.padded_vocab_size, h, tp)
        model.lm_head = VocabParallelLMHead(cfg.vocab_size, tp, sp)


def tp_partition_dims(model: nn.Module) -> dict[str, int | None]:
    """Parameter name → the dim split across TP ranks (None: replicated), for grad norm and checkpoints."""
    dims = {}
    for mod_name, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            name = f"{mod_name}.{pname}" if mod_name else pname
            dims[name] = module.partition_dim(pname) if hasattr(module, "partition_dim") else None
    return dims


def sequence_parallel_param_names(model: nn.Module) -> list[str]:
    """Replicated parameters applied to sequence-sharded activations under SP (LayerNorms and the
    row-parallel biases): each TP rank sees only its positions, so their gradients are TP-summed."""
    return [name for name, _ in model.named_parameters() if _in_sequence_region(name)]


def _in_sequence_region(name: str) -> bool:
    if sharding.kind(name) != sharding.REPLICATED:
        return False
    if "layernorm" in name:
        return True
    return name.endswith(".bias") and sharding.kind(name[: -len("bias")] + "weight") == sharding.ROW
