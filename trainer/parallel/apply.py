"""Applying parallelism to the single-device GPT from outside: the stage split and the TP plan.

``stage_spec`` picks this pipeline stage's layers (first stage: embedding; last: final LN, head, loss).
``apply_tensor_parallel`` swaps modules by a plan (Megatron's split of a transformer layer):

| module                                  | becomes                 | split                            |
|-----------------------------------------|-------------------------|----------------------------------|
| self_attention.query_key_value          | ColumnParallelLinear    | heads (rows of W, bias)          |
| self_attention.dense                    | RowParallelLinear       | columns of W; bias replicated    |
| mlp.dense_h_to_4h                       | ColumnParallelLinear    | rows of W, bias                  |
| mlp.dense_4h_to_h                       | RowParallelLinear       | columns of W; bias replicated    |
| embedding.word_embeddings (+ _for_head) | VocabParallelEmbedding  | vocabulary rows                  |
| lm_head                                 | VocabParallelLMHead     | vocabulary (CE never gathers)    |

and points the dropout RNG hooks at the tracker's fork where activations are sharded (attention always;
embedding and residual dropout only under sequence parallelism, which also swaps in the sequence
scatter after the embedding).
"""

from __future__ import annotations

from torch import nn

from trainer.model.config import GPTConfig
from trainer.model.gpt import GPT, StageSpec
from trainer.parallel.config import ParallelConfig
from trainer.parallel.random import RNGTracker
from trainer.parallel.state import ParallelState
from trainer.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    ScatterToSequence,
    VocabParallelEmbedding,
    VocabParallelLMHead,
)


def check_compatible(cfg: GPTConfig, pcfg: ParallelConfig) -> None:
    """The model's shape must split evenly under the layout; errors say which field to change."""
    tp, pp = pcfg.tp_size, pcfg.pp_size
    if cfg.num_layers % pp:
        raise ValueError(f"model.num_layers={cfg.num_layers} does not divide by parallel.pp_size={pp}")
    if cfg.num_attention_heads % tp:
        raise ValueError(f"model.num_attention_heads={cfg.num_attention_heads} does not divide by "
                         f"parallel.tp_size={tp}")
    if cfg.ffn_hidden_size % tp:
        raise ValueError(f"model.ffn_hidden_size={cfg.ffn_hidden_size} does not divide by "
                         f"parallel.tp_size={tp}")
    if pcfg.sequence_parallel and cfg.seq_length % tp:
        raise ValueError(f"parallel.sequence_parallel needs model.seq_length={cfg.seq_length} divisible by "
                         f"parallel.tp_size={tp}")


def stage_spec(num_layers: int, pp_rank: int, pp_size: int) -> StageSpec:
    """This stage's contiguous block of num_layers / pp_size layers."""
    per_stage = num_layers // pp_size
    return StageSpec(pp_rank * per_stage, (pp_rank + 1) * per_stage, pre_process=pp_rank == 0,
                     post_process=pp_rank == pp_size - 1)


def apply_tensor_parallel(model: GPT, pstate: ParallelState, sequence_parallel: bool,
                          tracker: RNGTracker) -> None:
    """Swap ``model``'s modules for tensor-parallel ones in place (call on the meta device, then init)."""
    if pstate.tp_size == 1:
        return
    cfg, tp, sp = model.cfg, pstate.tp_group, sequence_parallel
    h, ffn = cfg.hidden_size, cfg.ffn_hidden_size
    for layer in model.encoder.layers:
        attn, mlp = layer.self_attention, layer.mlp
        attn.query_key_value = ColumnParallelLinear(h, 3 * h, tp, sp)
        attn.dense = RowParallelLinear(h, h, tp, sp)
        attn.dropout_rng = tracker.fork
        mlp.dense_h_to_4h = ColumnParallelLinear(h, ffn, tp, sp)
        mlp.dense_4h_to_h = RowParallelLinear(ffn, h, tp, sp)
        if sp:
            layer.dropout_rng = tracker.fork
    if model.stage.pre_process:
        model.embedding.word_embeddings = VocabParallelEmbedding(model.padded_vocab_size, h, tp)
        if sp:
            model.embedding.sequence_scatter = ScatterToSequence(tp)
            model.embedding.dropout_rng = tracker.fork
    if model.stage.post_process:
        if not model.stage.pre_process:
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
    return [name for name, dim in tp_partition_dims(model).items()
            if dim is None and ("layernorm" in name or name.endswith(("dense.bias", "dense_4h_to_h.bias")))]
