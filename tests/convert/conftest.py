"""Fixtures for the conversion tests: a tiny run tokenizer and random tiny GPT checkpoints at any layout.

Weights are random in Megatron names (not derived from the HF map), with a larger init than training so
that logits are well separated and greedy decoding is meaningful.
"""

from __future__ import annotations

import glob
import sys
from pathlib import Path

import pytest
import torch

from tests.threads import one_thread  # noqa: F401 (autouse)
from trainer.convert import names
from trainer.convert.shards import write_checkpoint
from trainer.convert.spec import GPTSpec
from trainer.formulas import padded_vocab_size

VOCAB = 1000  # real tokenizer size; padded to 1024 at tp 1 and tp 2



@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE (vocab.json + merges.txt) trained on the stdlib's own source, with <|endoftext|>."""
    from tokenizers import ByteLevelBPETokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    lib = Path(sys.modules["json"].__file__).parent.parent
    files = sorted(glob.glob(str(lib / "json" / "*.py")) + glob.glob(str(lib / "unittest" / "*.py")))
    tok = ByteLevelBPETokenizer()
    tok.train(files, vocab_size=VOCAB, min_frequency=2, special_tokens=["<|endoftext|>"], show_progress=False)
    tok.save_model(str(out))
    return out


def tiny_spec(tp: int = 1, vocab: int = VOCAB, layers: int = 4) -> GPTSpec:
    return GPTSpec(num_layers=layers, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                   max_position_embeddings=96, vocab_size=vocab,
                   padded_vocab_size=padded_vocab_size(vocab, tp))


def random_megatron_state(spec: GPTSpec, seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, f = spec.hidden_size, spec.ffn_hidden_size
    shapes = {
        names.WORD_EMBEDDINGS: (spec.padded_vocab_size, h),
        names.POSITION_EMBEDDINGS: (spec.max_position_embeddings, h),
        "input_layernorm.weight": (h,), "input_layernorm.bias": (h,),
        "self_attention.query_key_value.weight": (3 * h, h), "self_attention.query_key_value.bias": (3 * h,),
        "self_attention.dense.weight": (h, h), "self_attention.dense.bias": (h,),
        "post_attention_layernorm.weight": (h,), "post_attention_layernorm.bias": (h,),
        "mlp.dense_h_to_4h.weight": (f, h), "mlp.dense_h_to_4h.bias": (f,),
        "mlp.dense_4h_to_h.weight": (h, f), "mlp.dense_4h_to_h.bias": (h,),
        names.ENCODER + "final_layernorm.weight": (h,), names.ENCODER + "final_layernorm.bias": (h,),
    }
    state = {}
    for name in names.expected_megatron_names(spec.num_layers):
        key = name if name in shapes else name.split(".", 4)[-1]
        t = torch.randn(shapes[key], generator=g) * (0.1 if key.endswith("bias") else 0.15)
        if "layernorm.weight" in key:
            t = 1.0 + t
        state[name] = t.to(dtype)
    return state


def run_args(spec: GPTSpec, tok_dir: Path, tp: int, pp: int, **extra) -> dict:
    """Checkpoint args as Slipway writes them: plain types, Megatron names."""
    return {"num_layers": spec.num_layers, "hidden_size": spec.hidden_size,
            "num_attention_heads": spec.num_attention_heads, "ffn_hidden_size": spec.ffn_hidden_size,
            "seq_length": spec.max_position_embeddings,
            "max_position_embeddings": spec.max_position_embeddings,
            "padded_vocab_size": spec.padded_vocab_size, "vocab_size": spec.vocab_size,
            "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
            "vocab_file": str(tok_dir / "vocab.json"), "merge_file": str(tok_dir / "merges.txt"),
            "run_id": "test-run", "consumed_train_samples": 1200, "data_path": ["data/tiny_text_document"],
            **extra}


def make_checkpoint(root: Path, tok_dir: Path, tp: int, pp: int, iteration: int = 150, seed: int = 0,
                    **extra) -> tuple[Path, dict[str, torch.Tensor], GPTSpec]:
    spec = tiny_spec(tp)
    state = random_megatron_state(spec, seed)
    ckpt = root / f"ckpt_tp{tp}_pp{pp}"
    write_checkpoint(ckpt, state, run_args(spec, tok_dir, tp, pp, **extra), iteration, (tp, pp))
    return ckpt, state, spec


@pytest.fixture(scope="session")
def converted(tmp_path_factory, tokenizer_dir):
    """One (tp=2, pp=2) checkpoint converted once: (hf_dir, checkpoint_dir, state, spec, result)."""
    from trainer.convert.to_hf import ToHFConfig, convert_checkpoint

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("converted")
    ckpt, state, spec = make_checkpoint(root, tokenizer_dir, 2, 2)
    result = convert_checkpoint(ToHFConfig(ckpt, root / "hf"))
    torch.set_num_threads(before)
    return root / "hf", ckpt, state, spec, result
