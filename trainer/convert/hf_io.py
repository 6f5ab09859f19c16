"""The Hugging Face side on disk: config.json, generation_config.json and (sharded) safetensors."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from trainer.convert.spec import GPTSpec

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_SINGLE = "pytorch_model.bin"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KIB|MIB|GIB)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: str | int) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"`` or a byte count → bytes."""
    if isinstance(size, int):
        return size
    m = _SIZE.match(size)
    if not m:
        raise ValueError(f"size {size!r} is not like '5GB', '500MB' or a byte count")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()])


def hf_config(spec: GPTSpec, eod_id: int, dropout: dict[str, float]) -> Any:
    """GPT2Config for ``spec``; bos/eos/pad are the run's end-of-text id."""
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


def write_config(config: Any, dtype: torch.dtype, out_dir: Path) -> None:
    """config.json with both ``dtype`` (transformers ≥ 4.56) and ``torch_dtype`` (older readers)."""
    d = config.to_dict()
    name = str(dtype).removeprefix("torch.")
    d["dtype"] = d["torch_dtype"] = name
    (out_dir / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")


def write_generation_config(config: Any, out_dir: Path) -> None:
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(str(out_dir))


def _shards(state: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for name in state:
        nbytes = state[name].numel() * state[name].element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def save_weights(state: dict[str, torch.Tensor], out_dir: Path, max_shard_size: str | int) -> list[str]:
    """model.safetensors, or model-0000i-of-0000n.safetensors + index past ``max_shard_size``.

    Shards are serialised one at a time, so the extra memory is one shard, not the model."""
    from safetensors.torch import save_file

    groups = _shards(state, parse_size(max_shard_size))
    if len(groups) == 1:
        save_file({k: state[k].contiguous() for k in groups[0]}, str(out_dir / SAFE_SINGLE),
                  metadata={"format": "pt"})
        return [SAFE_SINGLE]
    files, weight_map = [], {}
    for i, group in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: state[k].contiguous() for k in group}, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, fname))
        files.append(fname)
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
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
