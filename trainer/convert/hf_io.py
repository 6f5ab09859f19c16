"""The Hugging Face side on disk: config.json, generation_config.json and (sharded) safetensors."""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainer.convert.spec import LLAMA, GPTSpec

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_SINGLE = "pytorch_model.bin"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KIB|MIB|GIB)?\s*$", re.IGNORECASE)
Producer = Callable[[str], torch.Tensor]
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def hf_positions(config: Any) -> int:
    """The positions a transformers config allows: GPT-2's ``n_positions``, Llama's
    ``max_position_embeddings`` (the one rule the converter's checks, sample and the eval stage share)."""
    return int(getattr(config, "n_positions", 0) or config.max_position_embeddings)


def parse_size(size: str | int) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"`` or a byte count → bytes."""
    if isinstance(size, int):
        return size
    m = _SIZE.match(size)
    if not m:
        raise ValueError(f"size {size!r} is not like '5GB', '500MB' or a byte count")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])


def hf_config(spec: GPTSpec, eod_id: int, dropout: dict[str, float]) -> Any:
    """GPT2Config or LlamaConfig for ``spec`` (its family); bos/eos/pad are the run's end-of-text id."""
    if spec.check_family() == LLAMA:
        return llama_config(spec, eod_id, dropout)
    from transformers import GPT2Config

    config = GPT2Config(
        vocab_size=spec.vocab_size, n_positions=spec.max_position_embeddings, n_embd=spec.hidden_size,
        n_layer=spec.num_layers, n_head=spec.num_attention_heads, n_inner=spec.ffn_hidden_size,
        activation_function=spec.activation, layer_norm_epsilon=spec.layernorm_epsilon,
        resid_pdrop=dropout.get("hidden", 0.1), embd_pdrop=dropout.get("hidden", 0.1),
        attn_pdrop=dropout.get("attention", 0.1), scale_attn_weights=True, tie_word_embeddings=True,
        bos_token_id=eod_id, eos_token_id=eod_id, pad_token_id=eod_id)
    config.architectures = ["GPT2LMHeadModel"]
    return config


def llama_config(spec: GPTSpec, eod_id: int, dropout: dict[str, float]) -> Any:
    """LlamaConfig: KV heads, rope θ, RMSNorm epsilon, tied or untied head, biases on or off (HF has one
    switch for attention and one for the MLP; Megatron's add_bias_linear sets both)."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.ffn_hidden_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.query_groups, head_dim=spec.hidden_size // spec.num_attention_heads,
        max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=spec.layernorm_epsilon,
        rope_theta=spec.rotary_base, hidden_act="silu", tie_word_embeddings=spec.tie_word_embeddings,
        attention_bias=spec.add_bias_linear, mlp_bias=spec.add_bias_linear,
        attention_dropout=dropout.get("attention", 0.0),
        bos_token_id=eod_id, eos_token_id=eod_id, pad_token_id=eod_id)
    config.architectures = ["LlamaForCausalLM"]
    return config


def write_config(config: Any, dtype: torch.dtype, out_dir: Path, name: str = "config.json") -> None:
    """config.json (or ``name``: the converter writes it unverified first, trainer.convert.swap) with both
    ``dtype`` (transformers ≥ 4.56) and ``torch_dtype`` (older readers); a Llama's rope θ also as
    ``rope_theta`` (transformers < 5 and other readers; 5 nests it in ``rope_parameters``)."""
    d = config.to_dict()
    d["dtype"] = d["torch_dtype"] = str(dtype).removeprefix("torch.")
    theta = (d.get("rope_parameters") or {}).get("rope_theta", getattr(config, "rope_theta", None))
    if d.get("model_type") == "llama" and theta is not None:
        d["rope_theta"] = theta
    (out_dir / name).write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")


def read_config(path: Path) -> Any:
    """A config file written by :func:`write_config`, as transformers reads it (any file name)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))


def write_generation_config(config: Any, out_dir: Path) -> None:
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(str(out_dir))


# safetensors dtype codes (https://github.com/huggingface/safetensors, format spec).
_ST_DTYPE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
             torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _shards(layout: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in layout.items():
        if groups[-1] and size + _nbytes(t) > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += _nbytes(t)
    return groups


def _write_safetensors(path: Path, layout: dict[str, torch.Tensor], produce: Producer) -> None:
    """Stream one safetensors file: the header from ``layout`` (meta tensors: shapes and dtypes), then
    each tensor's bytes as ``produce(name)`` makes it — at most one converted tensor in memory at a time."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in layout.items():
        header[name] = {"dtype": _ST_DTYPE[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + _nbytes(t)]}
        offset += _nbytes(t)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, meta in layout.items():
            t = produce(name).contiguous()
            if t.shape != meta.shape or t.dtype != meta.dtype:
                raise RuntimeError(f"{name}: produced {t.dtype}{tuple(t.shape)}, header says "
                                   f"{meta.dtype}{tuple(meta.shape)}")
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))  # little-endian, no copy
    tmp.replace(path)


def save_weights(layout: dict[str, torch.Tensor], produce: Producer, out_dir: Path,
                 max_shard_size: str | int) -> list[str]:
    """model.safetensors, or model-0000i-of-0000n.safetensors + index past ``max_shard_size``.

    ``layout`` names every tensor with a meta tensor of its shape and dtype; ``produce(name)`` makes the
    real one. Tensors are converted and written one by one, so writing needs no second copy of the model.
    """
    groups = _shards(layout, parse_size(max_shard_size))
    if len(groups) == 1:
        _write_safetensors(out_dir / SAFE_SINGLE, layout, produce)
        return [SAFE_SINGLE]
    files, weight_map = [], {}
    for i, group in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        _write_safetensors(out_dir / fname, {k: layout[k] for k in group}, produce)
        weight_map.update(dict.fromkeys(group, fname))
        files.append(fname)
    index = {"metadata": {"total_size": sum(_nbytes(t) for t in layout.values())}, "weight_map": weight_map}
    (out_dir / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return files + [SAFE_INDEX]


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF model directory: safetensors (single or sharded), else pytorch_model.bin."""
    from safetensors.torch import load_file

    if (model_dir / SAFE_SINGLE).is_file():
        return load_file(str(model_dir / SAFE_SINGLE))
    for index_name, loader in ((SAFE_INDEX, load_file),
                               ("pytorch_model.bin.index.json", _load_bin)):
        if (model_dir / index_name).is_file():
            files = sorted(set(json.loads((model_dir / index_name).read_text())["weight_map"].values()))
            state = {}
            for f in files:
                state.update(loader(str(model_dir / f)))
            return state
    if (model_dir / BIN_SINGLE).is_file():
        return _load_bin(str(model_dir / BIN_SINGLE))
    raise FileNotFoundError(f"{model_dir} has no model.safetensors, sharded safetensors or pytorch_model.bin")


def _load_bin(path: str) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)
