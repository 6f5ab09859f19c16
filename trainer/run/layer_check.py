"""The start-up check of kernels=compile_layer: one compiled transformer layer against the eager one.

The per-op self-check (trainer.ops.selfcheck) checks the csrc ops used outside the layers; inside them
kernels=compile_layer runs code Inductor generated for this node's device and compiler, which no test of
ours ran. So before step 1 a small layer of the model's kind (its head dim, norm, activation, positions
and biases; 2 heads, 16 positions, 2 sequences, no dropout) runs forward and backward three ways on the
job's device in the run's precision recipe: compiled, eager, and eager in fp32 (the exact reference).
The compiled layer passes when its worst error against the reference, over the output and every
gradient, is within twice the eager layer's own (plus the dtype's tolerance floor): compilation may round
differently, not worse. It costs one extra compilation of the small layer (static shapes), tens of
seconds on a GPU; ``train.kernel_check=off`` skips it. A failing layer falls back to the per-op csrc set
(policy fallback) or stops the job (policy fail), as a failing op does.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch

from trainer.config.model import ModelConfig
from trainer.ops.selfcheck import CHECK_SEED, OpResult
from trainer.ops.selfcheck_cases import TOLERANCES

OP, IMPL = "transformer_layer", "compile_layer"
SEQ, BATCH, HEADS = 16, 2, 2


def _small(cfg: ModelConfig) -> ModelConfig:
    groups = 1 if cfg.query_groups < cfg.num_attention_heads else HEADS  # keep GQA if the model has it
    ffn = None if cfg.activation == "swiglu" else 4 * HEADS * cfg.head_dim
    return dataclasses.replace(cfg, num_layers=1, hidden_size=HEADS * cfg.head_dim, num_attention_heads=HEADS,
                               num_query_groups=groups, ffn_hidden_size=ffn, seq_length=SEQ,
                               max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0)


def _run(layer, x: torch.Tensor, autocast: torch.dtype | None, compiled: bool) -> list[torch.Tensor]:
    """Output, then the gradients of the input and of every parameter, for a fixed output gradient."""
    from trainer.model.gpt import compiled_layer

    x = x.detach().clone().requires_grad_()
    ctx = torch.autocast(x.device.type, dtype=autocast) if autocast else torch.autocast(x.device.type,
                                                                                         enabled=False)
    with ctx:
        y = compiled_layer()(layer, x) if compiled else layer.block(x)
    g = torch.Generator(device="cpu").manual_seed(CHECK_SEED + 1)
    (y.float() * torch.randn(y.shape, generator=g).to(y.device)).sum().backward()
    return [y.detach().float(), x.grad.float()] + [p.grad.float() for p in layer.parameters()]


def _worst(got: list[torch.Tensor], exact: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max()) / max(1.0, float(b.abs().max())) for a, b in zip(got, exact,
                                                                                          strict=True))


def check_compiled_layer(cfg: ModelConfig, device: torch.device, compute: torch.dtype,
                         params: torch.dtype) -> OpResult:
    """The verdict for kernels=compile_layer on this rank (global RNG states are left as they were)."""
    from trainer.model.gpt import TransformerLayer
    from trainer.ops import reference_set

    result = OpResult(OP, IMPL, dtype=str(compute).removeprefix("torch."))
    small = _small(cfg)
    autocast = compute if params == torch.float32 and compute != torch.float32 else None
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices, device_type=device.type):
            kernels = dataclasses.replace(reference_set(), compile_layers=True)
            layer = TransformerLayer(small, kernels).to(device).train()
            g = torch.Generator().manual_seed(CHECK_SEED)
            with torch.no_grad():  # every parameter non-trivial (biases too), norm weights around 1
                for name, p in layer.named_parameters():
                    values = 0.1 * torch.randn(p.shape, generator=g) + (1.0 if "norm.weight" in name else 0.0)
                    p.copy_(values)
            layer = layer.to(params)
            exact_layer = copy.deepcopy(layer).float()  # the same (rounded) weights, computed in fp32
            x = torch.randn(SEQ, BATCH, small.hidden_size, generator=g).to(device, dtype=compute)
            exact = _run(exact_layer, x.float(), None, compiled=False)
            eager = _run(copy.deepcopy(layer), x, autocast, compiled=False)
            compiled = _run(layer, x, autocast, compiled=True)
        floor = TOLERANCES[compute][1]
        allowed = 2.0 * _worst(eager, exact) + floor
        error = _worst(compiled, exact)
        result.worse(error / allowed, error, allowed, (result.dtype, "output and gradients vs fp32 eager"))
    except Exception as e:  # noqa: BLE001 - a compiler that fails on this node is what this must catch
        result.ratio, result.max_error, result.tolerance = math.inf, math.inf, 0.0
        result.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    return result
