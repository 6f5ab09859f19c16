"""A local Hugging Face ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` directory → Slipway checkpoint
(Megatron layout) at any (tp, pp).

    python -m trainer.convert.from_hf --model-dir M --output-dir D --tp T --pp P [--iteration 0]

The result loads with ``checkpoint.load=model-only`` to fine-tune or continue pre-training. The vocab is
padded to a multiple of 128·tp (zero rows), QKV rows are put in Megatron's per-head (per KV group) order,
Llama's gate/up projections fused as [gate; up], and the model
tokenizer files are copied to ``D/tokenizer/``. The written checkpoint is read back, merged and checked
against the HF model on the same prompts (logits ≤ 1e-4, identical greedy generation).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint.megatron_args import megatron_args
from trainer.cli import Flags, add_dataclass_args, from_args
from trainer.config.model import ModelConfig
from trainer.convert import hf_io, llama, names
from trainer.convert.reference import make_source
from trainer.convert.shard_io import TRACKER, CheckpointError, prepare_output
from trainer.convert.shards import load_merged, write_checkpoint
from trainer.convert.spec import EOD_TOKEN, LLAMA, GPTSpec
from trainer.convert.tokenizer import RunTokenizer, build_hf_tokenizer
from trainer.convert.verify import VerifyConfig, VerifyReport, verify
from trainer.formulas import padded_vocab_size
from trainer.log import get_logger

log = get_logger(__name__)
_TANH_GELU = ("gelu_new", "gelu_fast", "gelu_pytorch_tanh")


@dataclass
class FromHFConfig:
    """One conversion from Hugging Face format."""

    model_dir: Path  # a local GPT2LMHeadModel or LlamaForCausalLM directory
    output_dir: Path  # the checkpoint directory to create
    tp_size: int = 1  # tensor-parallel size of the checkpoint written
    pp_size: int = 1  # pipeline-parallel size of the checkpoint written
    iteration: int = 0  # the iteration the checkpoint is saved as
    make_vocab_size_divisible_by: int = 128  # the vocab is padded to a multiple of this times tp (Megatron's)
    overwrite: bool = False  # replace an existing checkpoint directory
    verify: VerifyConfig = field(default_factory=VerifyConfig)

    def __post_init__(self) -> None:
        self.model_dir, self.output_dir = Path(self.model_dir), Path(self.output_dir)
        if self.tp_size < 1 or self.pp_size < 1 or self.iteration < 0:
            raise ValueError(f"tp={self.tp_size}, pp={self.pp_size}, iteration={self.iteration}: "
                             "sizes must be ≥ 1 and the iteration ≥ 0")


def read_spec(model_dir: Path, cfg: FromHFConfig) -> tuple[GPTSpec, Any]:
    """The GPTSpec of an HF GPT-2 directory, refusing what Slipway's GPT cannot represent exactly."""
    from transformers import AutoConfig

    if not (model_dir / "config.json").is_file():
        raise CheckpointError(f"{model_dir} has no config.json: not a Hugging Face model directory")
    hf = AutoConfig.from_pretrained(str(model_dir))
    if hf.model_type == "llama":
        return llama_spec(model_dir, hf, cfg), hf
    if hf.model_type != "gpt2":
        raise CheckpointError(f"{model_dir} is a {hf.model_type!r} model; only GPT-2 (GPT2LMHeadModel) and "
                              "Llama (LlamaForCausalLM) convert")
    needs = (("activation_function", "gelu_new"), ("scale_attn_weights", True),
             ("scale_attn_by_inverse_layer_idx", False), ("tie_word_embeddings", True),
             ("layer_norm_epsilon", 1e-5), ("add_cross_attention", False))
    tanh_ok = hf.activation_function in _TANH_GELU  # the same function under other names
    problems = [f"{k}={getattr(hf, k)!r} (needs {v!r})" for k, v in needs
                if getattr(hf, k, v) != v and not (k == "activation_function" and tanh_ok)]
    if problems:
        raise CheckpointError(f"{model_dir}: not convertible to Slipway's GPT without changing the model: "
                              + "; ".join(problems))
    ffn = hf.n_inner or 4 * hf.n_embd
    for what, size, div in (("n_head", hf.n_head, cfg.tp_size), ("n_inner", ffn, cfg.tp_size),
                            ("n_layer", hf.n_layer, cfg.pp_size)):
        if size % div:
            raise ValueError(f"{what}={size} is not divisible by {div}; choose tp dividing n_head and "
                             "n_inner and pp dividing n_layer")
    spec = GPTSpec(num_layers=hf.n_layer, hidden_size=hf.n_embd, num_attention_heads=hf.n_head,
                   ffn_hidden_size=ffn, max_position_embeddings=hf.n_positions, vocab_size=hf.vocab_size,
                   padded_vocab_size=padded_vocab_size(hf.vocab_size, cfg.tp_size,
                                                       cfg.make_vocab_size_divisible_by))
    return spec, hf


def _rope_theta(hf: Any) -> float:
    """rope θ of a LlamaConfig (transformers 5 nests it in rope_parameters), refusing rope scaling."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    scaling = getattr(hf, "rope_scaling", None)
    kind = params.get("rope_type", (scaling or {}).get("rope_type", "default"))
    if kind != "default":
        raise CheckpointError(f"rope_type={kind!r} (rope scaling) is not modelled by Slipway's rotary "
                              "embedding; only plain rope (rope_type 'default') converts")
    return float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))


def llama_spec(model_dir: Path, hf: Any, cfg: FromHFConfig) -> GPTSpec:
    """The GPTSpec of an HF LlamaForCausalLM directory, refusing what the GPT's options cannot express."""
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    groups = hf.num_key_value_heads or hf.num_attention_heads
    problems = [f"{k}={v!r} (needs {need!r})" for k, v, need in (
        ("hidden_act", hf.hidden_act, "silu"),
        ("head_dim", head_dim, hf.hidden_size // hf.num_attention_heads),
        ("mlp_bias", hf.mlp_bias, hf.attention_bias)) if v != need]
    theta = _rope_theta(hf)
    if problems:
        raise CheckpointError(f"{model_dir}: not convertible to Slipway's GPT without changing the model: "
                              + "; ".join(problems))
    for what, size, div in (("num_attention_heads", hf.num_attention_heads, cfg.tp_size),
                            ("num_key_value_heads", groups, cfg.tp_size),
                            ("intermediate_size", hf.intermediate_size, cfg.tp_size),
                            ("num_hidden_layers", hf.num_hidden_layers, cfg.pp_size)):
        if size % div:
            raise ValueError(f"{what}={size} is not divisible by {div}; choose tp dividing the heads, KV "
                             "heads and intermediate_size, and pp dividing the layers")
    return GPTSpec(num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size,
                   num_attention_heads=hf.num_attention_heads, ffn_hidden_size=hf.intermediate_size,
                   max_position_embeddings=hf.max_position_embeddings, vocab_size=hf.vocab_size,
                   padded_vocab_size=padded_vocab_size(hf.vocab_size, cfg.tp_size,
                                                       cfg.make_vocab_size_divisible_by),
                   layernorm_epsilon=hf.rms_norm_eps, activation="silu", position_embedding="rope",
                   rotary_base=theta, normalization="rmsnorm", num_query_groups=groups,
                   add_bias_linear=bool(hf.attention_bias), tie_word_embeddings=bool(hf.tie_word_embeddings))


def read_llama_state(model_dir: Path, spec: GPTSpec) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM weights; a tied model's lm_head (if stored) must equal embed_tokens."""
    state = hf_io.load_weights(model_dir)
    state = {k if k.startswith(("model.", "lm_head.")) else "model." + k: v for k, v in state.items()}
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}  # recomputed
    if spec.tie_word_embeddings:
        head = state.pop("lm_head.weight", None)
        if head is not None and not torch.equal(head, state["model.embed_tokens.weight"]):
            raise CheckpointError(f"{model_dir}: tie_word_embeddings is true but lm_head.weight differs from "
                                  "model.embed_tokens.weight")
    elif "lm_head.weight" not in state:
        raise CheckpointError(f"{model_dir}: tie_word_embeddings is false but there is no lm_head.weight")
    return state


def read_state(model_dir: Path) -> dict[str, torch.Tensor]:
    """HF weights with ``transformer.`` names (GPT2Model-style files lack the prefix), head checked tied."""
    state = hf_io.load_weights(model_dir)
    state = {k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k: v
             for k, v in state.items()}
    head = state.pop("lm_head.weight", None)
    if head is not None and not torch.equal(head, state["transformer.wte.weight"]):
        raise CheckpointError(f"{model_dir}: lm_head.weight differs from transformer.wte.weight; "
                              "Slipway ties them")
    return state


def copy_tokenizer(model_dir: Path, out: Path) -> RunTokenizer | None:
    """vocab.json + merges.txt into ``out`` (from tokenizer.json when only that exists); None if none."""
    out.mkdir(parents=True, exist_ok=True)
    if (model_dir / "vocab.json").is_file() and (model_dir / "merges.txt").is_file():
        for f in ("vocab.json", "merges.txt"):
            shutil.copyfile(model_dir / f, out / f)
    elif (model_dir / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        Tokenizer.from_file(str(model_dir / "tokenizer.json")).model.save(str(out))
    else:
        log.warning("%s has no tokenizer files; pass --vocab-file/--merge-file when converting back",
                    model_dir)
        return None
    return RunTokenizer(out / "vocab.json", out / "merges.txt")


def checkpoint_args(spec: GPTSpec, cfg: FromHFConfig, tok: RunTokenizer | None) -> argparse.Namespace:
    """The ``args`` Slipway's own checkpoints carry (Megatron's names, plain values; the architecture's
    fixed fields, tanh GeLU included, come from ``megatron_args``)."""
    return megatron_args({
        **ModelConfig(**spec.model_config()).megatron_architecture(),
        "num_layers": spec.num_layers, "hidden_size": spec.hidden_size,
        "num_attention_heads": spec.num_attention_heads, "ffn_hidden_size": spec.ffn_hidden_size,
        "seq_length": spec.max_position_embeddings, "max_position_embeddings": spec.max_position_embeddings,
        "vocab_size": spec.vocab_size, "padded_vocab_size": spec.padded_vocab_size,
        "make_vocab_size_divisible_by": cfg.make_vocab_size_divisible_by,
        "tensor_model_parallel_size": cfg.tp_size, "pipeline_model_parallel_size": cfg.pp_size,
        "tokenizer_type": "GPT2BPETokenizer",
        "vocab_file": str(tok.vocab_file.resolve()) if tok else None,
        "merge_file": str(tok.merge_file.resolve()) if tok else None,
        "iteration": cfg.iteration, "consumed_train_samples": 0, "consumed_valid_samples": 0,
        "converted_from": str(cfg.model_dir.resolve()),
    })


def convert_hf_model(cfg: FromHFConfig) -> VerifyReport:
    """Write the checkpoint, read it back and verify it against the HF model; returns the figures."""
    spec, _ = read_spec(cfg.model_dir, cfg)
    is_llama = spec.check_family() == LLAMA
    hf_state = read_llama_state(cfg.model_dir, spec) if is_llama else read_state(cfg.model_dir)
    prepare_output(cfg.output_dir, cfg.overwrite)
    tok = copy_tokenizer(cfg.model_dir, cfg.output_dir / "tokenizer")
    if tok is not None and tok.size > spec.vocab_size:
        raise CheckpointError(f"{cfg.model_dir}: tokenizer has {tok.size} tokens but the model only "
                              f"{spec.vocab_size} rows")
    state = (llama if is_llama else names).hf_to_megatron(hf_state, spec.shapes)
    del hf_state
    iter_dir = write_checkpoint(cfg.output_dir, state, checkpoint_args(spec, cfg, tok), cfg.iteration,
                                (cfg.tp_size, cfg.pp_size))
    del state
    merged = load_merged(iter_dir, cfg.iteration)
    hf_tok = build_hf_tokenizer(tok, spec.max_position_embeddings) if tok else None
    report = verify(make_source(merged.state, spec), cfg.model_dir, hf_tok, cfg.verify)
    if not report.passed:
        (cfg.output_dir / TRACKER).unlink(missing_ok=True)  # no loader picks up a wrong checkpoint
        (cfg.output_dir / "INVALID").write_text(report.summary() + "\n")
    (cfg.output_dir / "conversion.json").write_text(json.dumps(
        {"source": str(cfg.model_dir), "eod_token": EOD_TOKEN, "verification": report.summary(),
         "max_abs_logit_diff": report.max_abs_logit_diff, "greedy_identical": report.greedy_identical},
        indent=2) + "\n")
    return report


FLAGS = (Flags(FromHFConfig, skip=frozenset({"verify"}), rename={"tp_size": "tp", "pp_size": "pp"}),)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.convert.from_hf", description=__doc__.split("\n")[0])
    add_dataclass_args(p, FLAGS[0])
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        report = convert_hf_model(from_args(FLAGS[0], a))
    except (CheckpointError, FileExistsError, FileNotFoundError, ValueError) as e:
        sys.stderr.write(f"from_hf: error: {e}\n")
        return 2
    sys.stdout.write(f"{a.output_dir}: {report.summary()}\n")
    return 0 if report.passed else 3


if __name__ == "__main__":
    sys.exit(main())
