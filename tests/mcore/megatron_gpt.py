"""Megatron-core's ``GPTModel`` built, seeded and saved as Megatron-LM does, for the model checks
(``checks.model``). Runs only under one real megatron-core version; nothing from ``trainer`` is imported.

The model is configured from a checkpoint's Megatron-LM ``args`` the way Megatron-LM's
``core_transformer_config_from_args`` and ``model_provider`` do, for the options the oracle covers: GPT-2
(learned positions, LayerNorm, fused bias-GeLU, biases, tied head), Llama (rope, RMSNorm, SwiGLU,
grouped-query attention, no biases, untied head), ``--bf16``/``--fp16`` weights, and the options Slipway
refuses (mixture of experts, interleaved rotary, q/k LayerNorm, a QKV-only bias).
"""

from __future__ import annotations

import inspect


def arg(args, key: str, default=None):
    return args.get(key, default) if isinstance(args, dict) else getattr(args, key, default)


class TorchRMSNorm:
    """0.8.0's local spec has no RMSNorm (its torch and apex norms assert LayerNorm; Megatron-LM core_v0.8.0
    reaches RMSNorm only through Transformer Engine, which needs CUDA): torch's RMSNorm, with the
    signature Megatron's spec builder calls, stands in for TENorm there. Same formula, x·rsqrt(mean(x²) +
    eps)·w, and the same parameter name (``weight``)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        import torch

        return torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)


def _config(args, tp: int, dtype):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    swiglu, bias = bool(arg(args, "swiglu", False)), bool(arg(args, "add_bias_linear", True))
    fields = dict(
        num_layers=arg(args, "num_layers"), hidden_size=arg(args, "hidden_size"),
        num_attention_heads=arg(args, "num_attention_heads"), ffn_hidden_size=arg(args, "ffn_hidden_size"),
        layernorm_epsilon=arg(args, "norm_epsilon", arg(args, "layernorm_epsilon", 1e-5)),
        normalization=arg(args, "normalization", "LayerNorm"),
        num_query_groups=arg(args, "num_query_groups") if arg(args, "group_query_attention", False) else None,
        tensor_model_parallel_size=tp, use_cpu_initialization=True, params_dtype=dtype,
        bf16=str(dtype) == "torch.bfloat16", fp16=str(dtype) == "torch.float16", hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=bias, add_qkv_bias=bool(arg(args, "add_qkv_bias", False)),
        # Megatron-LM's defaults --bias-gelu-fusion / --bias-swiglu-fusion: the jit-scripted fused
        # activations (they run on CPU).
        gated_linear_unit=swiglu, activation_func=F.silu if swiglu else F.gelu, bias_activation_fusion=True,
        rotary_interleaved=bool(arg(args, "rotary_interleaved", False)),
        qk_layernorm=bool(arg(args, "qk_layernorm", False)), num_moe_experts=arg(args, "num_experts"),
        moe_router_topk=arg(args, "moe_router_topk", 2),
        masked_softmax_fusion=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, apply_query_key_layer_scaling=False)
    return TransformerConfig(**fields)


def _layer_spec(config):
    """The local (non-Transformer-Engine) spec, as Megatron-LM's ``--transformer-impl local`` builds it."""
    from megatron.core.models.gpt import gpt_layer_specs

    make = gpt_layer_specs.get_gpt_layer_local_spec
    kwargs = {"num_experts": config.num_moe_experts, "qk_layernorm": config.qk_layernorm}
    if "normalization" in inspect.signature(make).parameters:  # 0.13 on
        kwargs["normalization"] = config.normalization
    try:
        spec = make(**kwargs)
    except NameError:  # 0.10.0's local MoE spec asks for Transformer Engine's grouped linear (use_te=True)
        spec = make(**{**kwargs, "num_experts": None})
        spec.submodules.mlp = gpt_layer_specs._get_moe_module_spec(use_te=False,
                                                                   num_experts=config.num_moe_experts)
    if config.normalization != "RMSNorm" or _has_torch_rmsnorm():
        return spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    for slot in ("input_layernorm", "pre_mlp_layernorm"):
        setattr(spec.submodules, slot, TorchRMSNorm)
    attention = spec.submodules.self_attention.submodules
    if config.qk_layernorm:
        attention.q_layernorm = attention.k_layernorm = TorchRMSNorm
    return TransformerBlockSubmodules(layer_specs=[spec] * config.num_layers, layer_norm=TorchRMSNorm)


def _has_torch_rmsnorm() -> bool:
    """From 0.10 the local spec's norm (WrappedTorchNorm) builds torch's RMSNorm itself."""
    try:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm  # noqa: F401
    except ImportError:
        return False
    return True


def build_gpt(args, tp: int, dtype=None):
    """GPTModel with the local layer spec, configured from a checkpoint's Megatron args (``dtype``:
    params_dtype; default bf16 under ``args.bf16``, else fp32)."""
    import torch
    from megatron.core.models.gpt import GPTModel

    if dtype is None:
        dtype = (torch.bfloat16 if arg(args, "bf16", False) else torch.float16 if arg(args, "fp16", False)
                 else torch.float32)
    config = _config(args, tp, dtype)
    model = GPTModel(config, _layer_spec(config), vocab_size=arg(args, "padded_vocab_size"),
                    max_sequence_length=arg(args, "max_position_embeddings"), pre_process=True,
                    post_process=True, parallel_output=True,
                    share_embeddings_and_output_weights=not arg(args, "untie_embeddings_and_output_weights",
                                                                False),
                    position_embedding_type=arg(args, "position_embedding_type", "learned_absolute"),
                    rotary_percent=float(arg(args, "rotary_percent", 1.0)),
                    rotary_base=arg(args, "rotary_base", 10000))
    # Megatron-LM's --bf16 (--fp16) wraps the model in Float16Module, which casts every parameter (norms
    # included, whatever params_dtype the module chose) with module.bfloat16() (.half()); the weights it
    # saves are those.
    return model.to(dtype) if dtype in (torch.bfloat16, torch.float16) else model


def fresh_model(args, tp: int):
    """GPTModel with Megatron's own init (seeded), biases and norms moved off 0/1 so that a dropped or
    misplaced one shows in the logits (the same noise on every tp rank keeps replicated ones equal)."""
    import torch

    torch.manual_seed(1234)  # use_cpu_initialization: the full weight from torch's RNG, then split
    model = build_gpt(args, tp)
    perturb(model)
    return model


def perturb(model) -> None:
    """Biases and norms off 0/1 by seeded noise, the same on every rank (replicated ones stay equal)."""
    import torch

    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_((torch.randn(p.shape, generator=g) * 0.1).to(p.dtype))


def megatron_args(job: dict):
    """Megatron-LM's args for the export: those core_v0.8.0's Megatron-LM wrote for a genuine fixture
    (``job["args_from"]``, a torch_dist common.pt), with ``job["args"]`` applied on top."""
    import torch

    args = torch.load(job["args_from"], map_location="cpu", weights_only=False)["args"]
    for key, value in job["args"].items():
        setattr(args, key, value)
    if args.bf16 or getattr(args, "fp16", False):  # what validate_args derives from --bf16 / --fp16
        args.params_dtype = torch.bfloat16 if args.bf16 else torch.float16
    return args


def export(model, args, job: dict, rank: int) -> None:
    """Save as Megatron-LM's save_checkpoint does: ``torch_dist`` (sharded_state_dict +
    dist_checkpointing.save) or ``torch`` (state_dict_for_save_checkpoint per tp rank)."""
    import os

    import torch

    iter_dir = f"{job['dir']}/iter_{job['iteration']:07d}"
    state = {"args": args, "checkpoint_version": 3.0, "iteration": job["iteration"]}
    if job["format"] == "torch_dist":
        from megatron.core import dist_checkpointing

        if rank == 0:
            os.makedirs(iter_dir, exist_ok=True)
        torch.distributed.barrier()
        dist_checkpointing.save({**state, "model": model.sharded_state_dict()}, iter_dir)
    else:
        os.makedirs(f"{iter_dir}/mp_rank_{rank:02d}", exist_ok=True)
        torch.save({**state, "model": model.state_dict_for_save_checkpoint()},
                   f"{iter_dir}/mp_rank_{rank:02d}/model_optim_rng.pt")
    torch.distributed.barrier()
    if rank == 0:
        with open(f"{job['dir']}/latest_checkpointed_iteration.txt", "w") as f:
            f.write(str(job["iteration"]))
