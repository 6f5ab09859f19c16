"""A checkpoint's ``args`` is what Megatron-LM and transformers read: an ``argparse.Namespace`` of plain
values under Megatron's names (formats.md §4); dict args of older Slipway checkpoints still load, resume."""

import argparse
import os
import shutil

import pytest
import torch

from tests.train.harness import VOCAB, run_cfg, tiny_config, write_dataset
from trainer.checkpoint import protocol as ckpt
from trainer.checkpoint import verify as ckpt_verify
from trainer.checkpoint.files import arg
from trainer.checkpoint.megatron_args import READER_ARGS
from trainer.convert.spec import _activation

ITERS, SAVE = 10, 5


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny run's checkpoints (iterations 5 and 10 kept) and its losses."""
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("megatron-args")
    data = write_dataset(str(tmp / "data"))
    r = run_cfg(tiny_config(str(tmp / "src"), data, train={"iters": ITERS, "save_interval": SAVE},
                            checkpoint={"keep": None}))
    return tmp, data, str(tmp / "src" / "checkpoints"), r.losses


def _args(ckpt_dir: str, iteration: int = ITERS):
    return ckpt.load_file(ckpt.shard_path(ckpt_dir, iteration, 0, 0, 1))["args"]


def _plain(value) -> bool:
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return value is None or type(value) in (bool, int, float, str)


def test_args_are_a_megatron_namespace_of_plain_values(saved):
    args = _args(saved[2])
    assert type(args) is argparse.Namespace
    missing = [n for n in READER_ARGS if not hasattr(args, n)]
    assert not missing, missing
    odd = {k: type(v).__name__ for k, v in vars(args).items() if not _plain(v)}
    assert not odd, odd
    shape = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 128,
             "kv_channels": 8, "num_query_groups": 1, "seq_length": 16, "max_position_embeddings": 16,
             "vocab_size": VOCAB, "padded_vocab_size": 256, "make_vocab_size_divisible_by": 128,
             "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "iteration": ITERS,
             "consumed_train_samples": ITERS * 4, "add_position_embedding": True,
             "position_embedding_type": "learned_absolute", "normalization": "LayerNorm",
             "use_legacy_models": True, "transformer_impl": "local", "tokenizer_type": "GPT2BPETokenizer",
             "fp16": False, "bf16": False, "params_dtype": "float32", "swiglu": False,
             "untie_embeddings_and_output_weights": False, "bias_gelu_fusion": True, "openai_gelu": False}
    assert {k: getattr(args, k) for k in shape} == shape
    assert args.norm_epsilon == args.layernorm_epsilon == 1e-5
    assert args.run_dir and hasattr(args, "kernels")  # Slipway's own fields stay
    assert _activation(args) == "gelu_new"  # converting to HF picks the tanh GeLU back


def test_shard_loads_with_torch_weights_only_and_namespace_allowed(saved):
    path = ckpt.shard_path(saved[2], ITERS, 0, 0, 1)
    with torch.serialization.safe_globals([argparse.Namespace]):
        shard = torch.load(path, weights_only=True)
    assert shard["args"].num_layers == 2 and shard["checkpoint_version"] == 3.0


def _megatron_check_checkpoint_args(checkpoint_args, args, version: float = 3.0) -> None:
    """The comparisons of Megatron-LM core_v0.8.0 check_checkpoint_args (torch format, run with
    --vocab-file): attribute access, no default except add_position_embedding."""
    names = ["num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings",
             "make_vocab_size_divisible_by", "padded_vocab_size", "tokenizer_type"]
    names += ["tensor_model_parallel_size", "pipeline_model_parallel_size"] if version >= 3.0 else []
    for name in names:
        assert getattr(checkpoint_args, name) == getattr(args, name), name
    assert getattr(checkpoint_args, "add_position_embedding", True) == args.add_position_embedding


def _transformers_reads(ds_args) -> dict:
    """What transformers v4.27's convert_megatron_gpt2_checkpoint.py takes from ``ds_args``."""
    config = {"vocab_size": ds_args.padded_vocab_size, "n_positions": ds_args.max_position_embeddings,
              "n_embd": ds_args.hidden_size, "n_layer": ds_args.num_layers,
              "n_head": ds_args.num_attention_heads, "n_inner": ds_args.ffn_hidden_size}
    if ds_args.bias_gelu_fusion:
        config["activation_function"] = "gelu_fast"
    elif ds_args.openai_gelu:
        config["activation_function"] = "gelu_new"
    else:
        config["activation_function"] = "gelu"
    assert ds_args.tokenizer_type in ("GPT2BPETokenizer", "PretrainedFromHF")  # else it raises
    return config


def test_megatron_and_transformers_read_the_args_by_attribute(saved):
    args = _args(saved[2])
    _megatron_check_checkpoint_args(args, argparse.Namespace(**vars(args)))
    assert args.consumed_train_samples == ITERS * 4 and isinstance(args.consumed_valid_samples, int)
    config = _transformers_reads(args)
    assert config == {"vocab_size": 256, "n_positions": 16, "n_embd": 32, "n_layer": 2, "n_head": 4,
                      "n_inner": 128, "activation_function": "gelu_fast"}  # gelu_fast: the tanh GeLU
    read = ("padded_vocab_size", "max_position_embeddings", "hidden_size", "num_layers",
            "num_attention_heads", "ffn_hidden_size", "bias_gelu_fusion", "openai_gelu", "tokenizer_type")
    assert set(read) <= set(READER_ARGS)


def _as_old_checkpoint(ckpt_dir: str, iteration: int) -> None:
    """Rewrite a shard as older Slipway wrote it (args a dict), with a matching manifest."""
    path = ckpt.shard_path(ckpt_dir, iteration, 0, 0, 1)
    shard = ckpt.load_file(path)
    shard["args"] = dict(vars(shard["args"]))
    torch.save(shard, path)
    ckpt_verify.write_digest(os.path.dirname(path), ckpt.SHARD_FILE)
    ckpt_verify.write_manifest(ckpt.iter_path(ckpt_dir, iteration), iteration, 1, 1, ckpt.SHARD_FILE)


def test_old_checkpoint_with_dict_args_resumes_and_loads_model_only(saved):
    tmp, data, src_ckpt, losses = saved
    old = str(tmp / "old")
    os.makedirs(old)
    for it in (SAVE, ITERS):
        shutil.copytree(ckpt.iter_path(src_ckpt, it), os.path.join(old, ckpt.iter_dir_name(it)))
        _as_old_checkpoint(old, it)
    with open(os.path.join(old, ckpt.TRACKER), "w") as f:
        f.write(str(ITERS))
    shard = torch.load(ckpt.shard_path(old, SAVE, 0, 0, 1), weights_only=True)  # no Namespace left
    assert type(shard["args"]) is dict and arg(shard["args"], "num_layers") == 2
    tp, pp, args = ckpt.saved_layout(old, SAVE)
    assert (tp, pp) == (1, 1) and isinstance(args, dict)
    resumed = run_cfg(tiny_config(str(tmp / "resumed"), data, train={"iters": ITERS},
                                  checkpoint={"load": SAVE, "load_dir": old}))
    assert sorted(resumed.losses) == list(range(SAVE + 1, ITERS + 1))
    assert all(resumed.losses[i] == losses[i] for i in resumed.losses)  # exact resume from dict args
    fine = run_cfg(tiny_config(str(tmp / "fine"), data, train={"iters": 2},
                               checkpoint={"load": "model-only", "load_dir": old}))
    assert sorted(fine.losses) == [1, 2]
    assert type(_args(str(tmp / "fine" / "checkpoints"), 2)) is argparse.Namespace  # saves the new form
