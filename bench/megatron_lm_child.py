"""The Megatron-LM side of bench/megatron_lm.py: runs as ``python bench/megatron_lm_child.py JOB`` (or
``--preprocess ARGS``) with one Megatron-LM tree first on PYTHONPATH and the tree as the working folder,
under the Python the tag needs (its pyproject's requires-python: 3.12 from core_v0.17). Nothing from
``trainer`` is imported here (the expected side must not share code with what it checks); no file of
Megatron-LM is edited: the runtime patches below are listed in the results, each with its reason.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _cpu_patches() -> list[str]:
    """Runtime stand-ins that Megatron-LM's training code needs on a CPU-only torch (or a CUDA build
    without a GPU); returns their names. Each was checked necessary by leaving it out (the error it then
    stops with is given).

    1. The legacy model's LayerNorm (``megatron.legacy.model.fused_layer_norm.MixedFusedLayerNorm``)
       imports the ``fused_layer_norm_cuda`` extension in ``__init__`` ("No module named
       'fused_layer_norm_cuda'") and calls apex's ``fused_layer_norm_affine`` (None without apex): an
       empty module stands in for the extension and that module's global becomes ``F.layer_norm``
       (arguments reordered). Not a fake ``apex`` package: Megatron-core's local layer spec would then
       pick apex's FusedLayerNorm over torch's LayerNorm. Legacy model only (gone in core_v0.19).
    2. ``get_cuda_rng_tracker().fork`` is a no-op context ("cuda rng state model-parallel-rng is not
       added"): entered around attention dropout (0 here); the tracker gets its states from
       ``model_parallel_cuda_manual_seed``, which ``initialize_megatron`` calls only with a GPU.
    3. ``torch.cuda.current_device()`` names the CPU ("Torch not compiled with CUDA enabled"): tensors
       Megatron creates "on the current device" (the attention scratch buffer that baddbmm uses with
       beta=0, GlobalMemoryBuffer; the model's move in ``get_model``) stay on the CPU.
    4. ``Module.cuda``/``Tensor.cuda`` return self ("Invalid device, must be cuda device"): ``get_model``
       moves the model with ``.cuda(torch.cuda.current_device())``.
    5. ``torch.tensor(..., device='cuda')`` → CPU ("Torch not compiled with CUDA enabled"):
       ``read_metadata`` all-reduces the iteration it read from latest_checkpointed_iteration.txt as a
       CUDA tensor; gloo reduces a CPU one the same.
    6. ``argparse.Namespace`` allowed by ``torch.load(weights_only=True)``, torch ≥ 2.6's default, which
       core_v0.8.0 predates ("Unsupported global: GLOBAL argparse.Namespace"; load_checkpoint prints it
       and exits with status 0): a checkpoint's ``args``. Slipway's are plain values, nothing else.
    7. ``torch.cuda.get_device_properties`` describes a compute capability 9.0 device where the tag's
       ``validate_args`` asks the architecture with tp > 1 (core_v0.13 on; "Found no NVIDIA driver" at
       core_v0.19.0's tp 2); 9.0 keeps the pre-Blackwell rule (CUDA_DEVICE_MAX_CONNECTIONS=1, which the
       parent exports).
    """
    import argparse as _argparse
    import contextlib
    import importlib
    import importlib.util
    import types

    import torch
    import torch.nn.functional as F

    names = []
    importlib.import_module("pretrain_gpt")  # first: megatron.legacy.model alone is a circular import
    if importlib.util.find_spec("megatron.legacy") is not None:
        legacy_ln = importlib.import_module("megatron.legacy.model.fused_layer_norm")
        legacy_ln.fused_layer_norm_affine = lambda x, w, b, shape, eps: F.layer_norm(x, shape, w, b, eps)
        sys.modules["fused_layer_norm_cuda"] = types.ModuleType("fused_layer_norm_cuda")
        names.append("legacy LayerNorm: apex → F.layer_norm")
    torch.cuda.current_device = lambda: "cpu"
    torch.nn.Module.cuda = lambda self, *a, **k: self
    torch.Tensor.cuda = lambda self, *a, **k: self
    tensor = torch.tensor

    def cpu_tensor(*a, **k):
        if str(k.get("device", "")).startswith("cuda"):
            k["device"] = "cpu"
        return tensor(*a, **k)

    torch.tensor = cpu_tensor
    torch.serialization.add_safe_globals([_argparse.Namespace])
    if "get_device_arch_version" in Path("megatron/training/arguments.py").read_text():  # core_v0.19
        torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(major=9, minor=0, name="cpu")
        names.append("get_device_properties → sm 9.0")
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    return names + ["CUDA RNG tracker fork → no-op", "current_device → cpu", ".cuda() → identity",
                    "torch.tensor(device=cuda) → cpu", "weights_only: allow Namespace"]


def _triton_stand_in() -> list[str]:
    """8. Only where triton is not installed (a CPU torch): from core_v0.16 ``import megatron.training``
    imports the batch-invariant Triton kernels (training/initialize.py → custom_layers/
    batch_invariant_kernels.py; used only with --batch-invariant-mode, on a GPU), which need ``triton.jit``
    and ``triton.language`` at import. A stand-in triton (``jit`` returns the function) is in
    ``sys.modules`` only while that one module imports, so nothing else (torch's own probes for triton,
    ``megatron.core.utils.HAVE_TRITON``) ever sees it."""
    import importlib
    import importlib.util
    import types

    kernels = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
    if importlib.util.find_spec("triton") is not None or importlib.util.find_spec(kernels) is None:
        return []
    triton, language = types.ModuleType("triton"), types.ModuleType("triton.language")
    triton.jit = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)
    triton.cdiv = lambda a, b: -(-a // b)
    language.__getattr__ = lambda name: object  # annotations such as tl.constexpr
    triton.language = language
    sys.modules.update({"triton": triton, "triton.language": language})
    try:
        importlib.import_module(kernels)
    finally:
        del sys.modules["triton"], sys.modules["triton.language"]
    return ["triton stand-in while importing batch_invariant_kernels"]


def preprocess_child(argv: list[str]) -> None:
    """Megatron-LM's tools/preprocess_data.py as ``__main__`` (cwd: the tree, on sys.path), after
    :func:`_triton_stand_in`; its 2 workers are forks, so they inherit the imported modules."""
    import runpy

    _triton_stand_in()
    sys.argv = ["tools/preprocess_data.py", *argv]
    runpy.run_path("tools/preprocess_data.py", run_name="__main__")


def megatron_argv(job: dict) -> list[str]:
    """Megatron-LM's flags for the job's model (what a user passes for it: GPT-2 is the parser's defaults,
    Llama-style adds the architecture flags) and the CPU run; no flag that relaxes the checkpoint check."""
    m = job["model"]
    argv = ["--num-layers", m["num_layers"], "--hidden-size", m["hidden_size"],
            "--num-attention-heads", m["num_attention_heads"], "--seq-length", m["seq_length"],
            "--max-position-embeddings", m["max_position_embeddings"], "--micro-batch-size", 1,
            "--global-batch-size", 1, "--train-iters", 1, "--lr", 0.0,
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", job["vocab"],
            "--merge-file", job["merges"], "--tensor-model-parallel-size", job["tp"],
            "--load", job["load"], "--no-load-optim", "--no-load-rng", "--use-cpu-initialization",
            "--transformer-impl", "local", "--distributed-backend", "gloo", "--hidden-dropout", 0.0,
            "--attention-dropout", 0.0, "--no-masked-softmax-fusion", "--no-bias-dropout-fusion",
            "--no-gradient-accumulation-fusion", "--no-persist-layer-norm"]
    if m.get("ffn_hidden_size"):
        argv += ["--ffn-hidden-size", m["ffn_hidden_size"]]
    if m.get("position_embedding") == "rope":  # the fused rope is Transformer Engine's: off on a CPU
        argv += ["--position-embedding-type", "rope", "--rotary-base", int(m["rotary_base"]),
                 "--no-rope-fusion"]
    if m.get("normalization") == "rmsnorm":
        argv += ["--normalization", "RMSNorm"]
    if m.get("activation") == "swiglu":
        argv.append("--swiglu")
    if m.get("num_query_groups"):
        argv += ["--group-query-attention", "--num-query-groups", m["num_query_groups"]]
    if not m.get("add_bias_linear", True):
        argv.append("--disable-bias-linear")
    if not m.get("tie_word_embeddings", True):
        argv.append("--untie-embeddings-and-output-weights")
    # core_v0.8.0 builds the legacy model unless told --use-mcore-models; later tags the reverse.
    argv.append("--use-legacy-models" if job["kind"] == "legacy" else "--use-mcore-models")
    # Slipway writes the torch format (mp_rank_00/model_optim_rng.pt) or torch_dist; from core_v0.10 the
    # default --ckpt-format is torch_dist, which the legacy model refuses outright.
    if "ckpt_format" in Path("megatron/training/arguments.py").read_text():  # not in core_v0.8.0
        argv += ["--ckpt-format", job["format"]]
    return [str(a) for a in argv]


def _hf_tokenizer(args, patches: list[str]) -> bool:
    """9. From core_v0.17 GPT2BPETokenizer is Hugging Face's AutoTokenizer("gpt2") (megatron/core/
    tokenizers), which needs the Hub even with --vocab-file and --merge-file ("Unable to instantiate
    HuggingFace AutoTokenizer for gpt2"): the tokenizer is not built (nothing here tokenizes) and the
    padded vocabulary is what build_tokenizer would set, by Megatron's own vocab_size_with_padding of
    the vocab file's size. Returns whether the patch applies."""
    import importlib.util

    if importlib.util.find_spec("megatron.training.tokenizer") is not None:
        return False
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    with open(args.vocab_file) as f:
        args.padded_vocab_size = vocab_size_with_padding(len(json.load(f)), args, logging_enabled=False)
    patches.append("GPT2BPETokenizer not built (HF Hub); padded vocab by vocab_size_with_padding")
    return True


def _megatron_model(job: dict, rank: int, patches: list[str]):
    """Megatron-LM's own set-up: its arguments, globals (padded vocab), model-parallel groups,
    ``get_model(model_provider)``; returns the model and the iteration ``load_checkpoint`` reports."""
    import pretrain_gpt
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType
    from megatron.training import checkpointing, training
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(job["tp"]))
    sys.argv = ["pretrain_gpt.py", *megatron_argv(job)]
    args = parse_args()
    if job["kind"] == "legacy" and not hasattr(args, "apply_layernorm_1p"):
        # 10. From core_v0.16 the parser is generated from TransformerConfig (Megatron-LM 639c08ab82),
        # which names the option layernorm_zero_centered_gamma; the legacy model (legacy/model/utils.py
        # get_norm) still reads args.apply_layernorm_1p. Same option, so the old name gets its value.
        args.apply_layernorm_1p = args.layernorm_zero_centered_gamma
        patches.append("args.apply_layernorm_1p ← layernorm_zero_centered_gamma")
    validate_args(args)
    import importlib.util

    hf = importlib.util.find_spec("megatron.training.tokenizer") is None
    set_global_variables(args, build_tokenizer=not hf)
    if hf:
        _hf_tokenizer(args, patches)
    # initialize_megatron's _initialize_distributed skips the model-parallel groups without a GPU.
    dist.init_process_group("gloo", init_method=f"file://{job['store']}", rank=rank, world_size=job["tp"])
    parallel_state.initialize_model_parallel(job["tp"], 1)
    provider = pretrain_gpt.model_provider
    if hasattr(pretrain_gpt, "gpt_builder"):  # core_v0.16: what pretrain_gpt's __main__ passes to pretrain
        from functools import partial

        provider = partial(provider, pretrain_gpt.gpt_builder)
    model = training.get_model(provider, ModelType.encoder_or_decoder, wrap_with_ddp=False)
    iteration = checkpointing.load_checkpoint(model, None, None, strict=True)
    iteration = iteration[0] if isinstance(iteration, tuple) else iteration
    return model[0].eval(), iteration, type(model[0]).__module__ + "." + type(model[0]).__name__


def _rank(rank: int, job: dict, patches: list[str]) -> None:
    """One tp rank: load, forward on the job's tokens, logits gathered over tp; rank 0 writes them."""
    import numpy as np
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    model, iteration, cls = _megatron_model(job, rank, patches)
    ids = torch.from_numpy(np.load(job["tokens"]))
    s = ids.shape[1]
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)  # True = masked (get_ltor_masks_and_position_ids)
    with torch.no_grad():
        logits = model(ids, torch.arange(s)[None].expand_as(ids), mask).float().contiguous()
    parts = [torch.empty_like(logits) for _ in range(job["tp"])]
    dist.all_gather(parts, logits)
    if rank == 0:
        np.save(job["out"], torch.cat(parts, dim=-1).numpy())
        Path(job["summary"]).write_text(json.dumps({"patches": patches, "iteration": int(iteration),
                                                    "model_class": cls}))
    dist.destroy_process_group()


def child(job_file: str) -> int:
    """One Megatron-LM load + forward on ``job["tp"]`` forked gloo ranks; writes the logits (.npy) and a
    JSON summary."""
    import torch.multiprocessing as mp

    job = json.loads(Path(job_file).read_text())
    patches = _triton_stand_in() + _cpu_patches()
    mp.start_processes(_rank, args=(job, patches), nprocs=job["tp"], start_method="fork")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--preprocess"]:
        preprocess_child(sys.argv[2:])
        sys.exit(0)
    sys.exit(child(sys.argv[1]))
