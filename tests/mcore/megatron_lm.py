"""Megatron-LM's own training-side code, for the versions whose wheel ships it (``megatron.training``, from
0.17: versions.HAS_TRAINING): its argument parser builds the args, ``training.get_model`` the model (with
``Float16Module`` under ``--fp16``/``--bf16``), ``checkpointing.save_checkpoint`` writes the checkpoints
and ``checkpointing.load_checkpoint`` (strict) reads Slipway's. Runs only under one real megatron-core
version, in a forked gloo rank (``checks._rank``); nothing from ``trainer`` is imported.

The model provider is ``gpt_builders.gpt_builder`` of Megatron-LM core_v0.19.0 (not in the wheel) for
``--transformer-impl local``: GPTModel with ``get_gpt_layer_local_spec``. CPU stand-ins are in
:func:`cpu_shims`, each with the error it prevents; no Megatron file is edited.
"""

from __future__ import annotations

import json
import os
import sys

# What every run passes for a CPU process: the local layers, torch's LayerNorm, no fused CUDA kernels (the
# fused rope is Transformer Engine's), a gloo group; --no-save-rng/--no-load-rng: the CUDA RNG state does
# not exist; --no-load-optim: Slipway's optimizer layout is its own (docs/megatron.md). Training-loop
# arguments validate_args requires.
CPU_FLAGS = ["--transformer-impl", "local", "--use-cpu-initialization", "--distributed-backend", "gloo",
             "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-dropout-fusion",
             "--no-persist-layer-norm", "--no-rope-fusion", "--no-save-rng", "--no-save-optim",
             "--no-load-rng", "--no-load-optim", "--micro-batch-size", "1", "--global-batch-size", "1",
             "--train-iters", "1", "--lr", "0", "--save-interval", "1", "--hidden-dropout", "0",
             "--attention-dropout", "0"]


def cpu_shims() -> None:
    """Stand-ins a CPU process needs (a CUDA build of torch without a GPU raises the same errors):

    - the CUDA RNG tracker's ``fork`` is a no-op (entered around attention dropout, 0 here; its states are
      added only by ``model_parallel_cuda_manual_seed``, on a GPU);
    - ``torch.cuda.current_device()`` names the CPU and ``.cuda()`` is the identity: ``get_model`` moves
      the model with ``.cuda(current_device())``; tensors made "on the current device" stay on the CPU;
    - ``torch.cuda.synchronize`` does nothing and ``torch.cuda.get_rng_state`` is the CPU generator's
      ("Found no NVIDIA driver"): ``save_checkpoint`` collects the RNG state even under --no-save-rng;
    - ``torch.tensor(..., device="cuda")`` is made on the CPU: ``read_metadata`` all-reduces the tracker's
      iteration as a CUDA tensor (gloo reduces a CPU one the same);
    - ``torch.cuda.get_device_properties`` describes a compute capability 9.0 device: from 0.19
      ``validate_args`` asks for the architecture with tp > 1 (before Blackwell it requires
      CUDA_DEVICE_MAX_CONNECTIONS=1, which :func:`parse` sets) ("Cannot re-initialize CUDA").
    """
    import contextlib
    from types import SimpleNamespace

    import torch
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.get_device_properties = lambda *a, **k: SimpleNamespace(major=9, minor=0, name="cpu")
    torch.nn.Module.cuda = lambda self, *a, **k: self
    torch.Tensor.cuda = lambda self, *a, **k: self
    tensor = torch.tensor

    def cpu_tensor(*a, **k):
        if str(k.get("device", "")).startswith("cuda"):
            k["device"] = "cpu"
        return tensor(*a, **k)

    torch.tensor = cpu_tensor


def parse(argv: list[str], rank: int, world: int):
    """Megatron-LM's args for ``argv`` (plus :data:`CPU_FLAGS`): ``parse_args``, ``validate_args``,
    ``set_global_variables``. The tokenizer is not built: from 0.17 GPT2BPETokenizer is Hugging Face's
    AutoTokenizer("gpt2"), which needs the Hub; the padded vocabulary is what build_tokenizer sets, by
    Megatron's own ``vocab_size_with_padding`` of the vocab file's size."""
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      CUDA_DEVICE_MAX_CONNECTIONS="1")  # what Megatron-LM's launch scripts export
    sys.argv = ["pretrain_gpt.py", *[str(a) for a in argv], *CPU_FLAGS]
    args = parse_args()
    validate_args(args)
    set_global_variables(args, build_tokenizer=False)
    with open(args.vocab_file) as f:
        args.padded_vocab_size = vocab_size_with_padding(len(json.load(f)), args, logging_enabled=False)
    return args


def provider(args):
    """gpt_builders.gpt_builder (core_v0.19.0) for --transformer-impl local."""
    def build(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None, **_):
        try:
            from megatron.training.arguments import core_transformer_config_from_args
        except ImportError:  # 0.19: moved to argument_utils
            from megatron.training.argument_utils import core_transformer_config_from_args
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        config = config or core_transformer_config_from_args(args)
        spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts,
                                        moe_grouped_gemm=config.moe_grouped_gemm,
                                        qk_layernorm=config.qk_layernorm, normalization=config.normalization)
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                        max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                        post_process=post_process, parallel_output=True,
                        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                        position_embedding_type=args.position_embedding_type,
                        rotary_percent=args.rotary_percent, rotary_base=args.rotary_base, vp_stage=vp_stage,
                        pg_collection=pg_collection)
    return build


def get_model(args):
    """``training.get_model`` (wrapped in Float16Module under --fp16/--bf16, never in DDP): one module."""
    from megatron.core.enums import ModelType
    from megatron.training import training

    return training.get_model(provider(args), ModelType.encoder_or_decoder, wrap_with_ddp=False)


def save(model: list, iteration: int) -> None:
    from megatron.training import checkpointing

    checkpointing.save_checkpoint(iteration, model, None, None, 0)


def load(model: list) -> int:
    """``load_checkpoint(strict=True)``: the args check and every key of the model."""
    from megatron.training import checkpointing

    loaded = checkpointing.load_checkpoint(model, None, None, strict=True)
    return int(loaded[0] if isinstance(loaded, tuple) else loaded)


def unwrap(module):
    """The GPTModel inside Megatron's Float16Module."""
    return getattr(module, "module", module)


def fields(args, names: list[str]) -> dict:
    """Megatron's values of ``names`` (those its args have), as JSON (dtypes and enums by name)."""
    out = {}
    for n in names:
        if hasattr(args, n):
            v = getattr(args, n)
            out[n] = v if v is None or isinstance(v, bool | int | float | str | list) else str(v)
    return out
