"""A tiny random GPT-2 in Hugging Face format (built here, no hub), its tokenizer, and a preprocessed
``.bin/.idx`` dataset of the standard library's source: what the eval stage reads after a conversion."""

from __future__ import annotations

import glob
import json
import sys
from pathlib import Path

import pytest

from tests.threads import one_thread  # noqa: F401 (autouse)

N_POSITIONS = 128


def _stdlib_files(n: int) -> list[str]:
    lib = Path(sys.modules["json"].__file__).parent.parent
    return sorted(glob.glob(str(lib / "json" / "*.py")) + glob.glob(str(lib / "email" / "*.py")))[:n]


@pytest.fixture(scope="session")
def tokenizer_files(tmp_path_factory) -> Path:
    from tokenizers import ByteLevelBPETokenizer

    out = tmp_path_factory.mktemp("eval-tokenizer")
    tok = ByteLevelBPETokenizer()
    tok.train(_stdlib_files(30), vocab_size=600, min_frequency=2, special_tokens=["<|endoftext|>"],
              show_progress=False)
    tok.save_model(str(out))
    return out


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory, tokenizer_files) -> Path:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from trainer.convert.tokenizer import RunTokenizer, save_tokenizer

    out = tmp_path_factory.mktemp("eval-hf")
    run_tok = RunTokenizer(tokenizer_files / "vocab.json", tokenizer_files / "merges.txt")
    hf_tok = save_tokenizer(run_tok, out, N_POSITIONS)
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(hf_tok), n_positions=N_POSITIONS, n_embd=32, n_layer=2, n_head=2,
                     bos_token_id=run_tok.eod_id, eos_token_id=run_tok.eod_id)
    GPT2LMHeadModel(cfg).eval().save_pretrained(out)
    (out / "README.md").write_text("# A model card\n\n## Conversion check\n\nPASSED.\n")
    return out


@pytest.fixture(scope="session")
def data_prefix(tmp_path_factory, tokenizer_files) -> str:
    from trainer.data.preprocess import PreprocessConfig, preprocess

    out = tmp_path_factory.mktemp("eval-data")
    jsonl = out / "code.jsonl"
    jsonl.write_text("".join(json.dumps({"content": Path(f).read_text()}) + "\n" for f in _stdlib_files(40)))
    preprocess(PreprocessConfig(input=str(jsonl), output_prefix=str(out / "data"), json_keys=["content"],
                                vocab_file=str(tokenizer_files / "vocab.json"),
                                merge_file=str(tokenizer_files / "merges.txt"), append_eod=True, workers=1,
                                progress="none"))
    return str(out / "data_content_document")
