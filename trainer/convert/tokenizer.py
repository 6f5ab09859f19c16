"""The run's own byte-level BPE tokenizer (vocab.json + merges.txt) as a Hugging Face GPT-2 tokenizer.

Megatron's GPT2BPETokenizer and HF's GPT-2 tokenizer share the byte-level BPE and the GPT-2
pre-tokenisation regex, so the same two files give the same ids. End-of-text is the run's
``<|endoftext|>`` id (not GPT-2's 50256), and it is bos, eos, unk and pad.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.convert.layout import CheckpointError
from trainer.convert.spec import EOD_TOKEN, arg

TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json")


@dataclass(frozen=True)
class RunTokenizer:
    """A run's tokenizer files; ``size`` is the real vocabulary (HF rows), ``eod_id`` its end-of-text id."""

    vocab_file: Path
    merge_file: Path

    def __post_init__(self) -> None:
        for path in (self.vocab_file, self.merge_file):
            if not path.is_file():
                raise CheckpointError(f"tokenizer file {path} does not exist; pass --vocab-file/--merge-file")

    @property
    def vocab(self) -> dict[str, int]:
        return json.loads(self.vocab_file.read_text(encoding="utf-8"))

    @property
    def size(self) -> int:
        return len(self.vocab)

    @property
    def eod_id(self) -> int:
        vocab = self.vocab
        if EOD_TOKEN not in vocab:
            raise CheckpointError(f"{self.vocab_file} has no {EOD_TOKEN} token; Megatron-style GPT "
                                  "training needs it as the document separator")
        return vocab[EOD_TOKEN]


def find_tokenizer(args: Any, search_dirs: list[Path], vocab_file: Path | None = None,
                   merge_file: Path | None = None) -> RunTokenizer | None:
    """The explicit files, else the paths in args, else vocab.json/merges.txt in one of ``search_dirs``."""
    if vocab_file or merge_file:
        if not (vocab_file and merge_file):
            raise CheckpointError("pass both --vocab-file and --merge-file, or neither")
        return RunTokenizer(Path(vocab_file), Path(merge_file))
    nested = arg(args, "tokenizer", None)
    for source in (args, nested if isinstance(nested, dict) else None):
        v, m = arg(source, "vocab_file"), arg(source, "merge_file")
        if v and m and Path(v).is_file() and Path(m).is_file():
            return RunTokenizer(Path(v), Path(m))
    for d in search_dirs:
        if (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
            return RunTokenizer(d / "vocab.json", d / "merges.txt")
    return None


def build_hf_tokenizer(tok: RunTokenizer, model_max_length: int) -> Any:
    """A ``GPT2TokenizerFast`` over the run's files, ``<|endoftext|>`` a special token."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers import GPT2TokenizerFast

    backend = Tokenizer(BPE.from_file(str(tok.vocab_file), str(tok.merge_file)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_special_tokens([AddedToken(EOD_TOKEN, special=True)])
    return GPT2TokenizerFast(tokenizer_object=backend, bos_token=EOD_TOKEN, eos_token=EOD_TOKEN,
                             unk_token=EOD_TOKEN, pad_token=EOD_TOKEN, model_max_length=model_max_length,
                             add_prefix_space=False)


def save_tokenizer(tok: RunTokenizer, out_dir: Path, model_max_length: int) -> Any:
    """Write all of TOKENIZER_FILES into ``out_dir``; returns the HF tokenizer."""
    hf_tok = build_hf_tokenizer(tok, model_max_length)
    hf_tok.save_pretrained(str(out_dir))
    shutil.copyfile(tok.vocab_file, out_dir / "vocab.json")
    shutil.copyfile(tok.merge_file, out_dir / "merges.txt")
    # Newer transformers fold this into tokenizer_config.json; older readers still look for it.
    special = {k: EOD_TOKEN for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return hf_tok
