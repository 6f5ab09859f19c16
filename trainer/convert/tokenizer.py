"""The run's own tokenizer, written next to the converted model so AutoTokenizer loads it from hf/.

GPT2BPETokenizer (vocab.json + merges.txt): Megatron's and HF's GPT-2 tokenizer share the byte-level BPE
and the GPT-2 pre-tokenisation regex, so the same two files give the same ids. End-of-text is the run's
``<|endoftext|>`` id (not GPT-2's 50256), and it is bos, eos, unk and pad.

HuggingFaceTokenizer (a tokenizer.json directory): its files are copied as they are (not re-saved, which
could rewrite them for this transformers version), and the copy is checked to encode as the original.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from trainer.convert.shard_io import CheckpointError
from trainer.convert.spec import EOD_TOKEN, arg
from trainer.data.hf_tokenizer import HF_TOKENIZER_TYPE

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
    def source(self) -> str:
        return str(self.vocab_file)

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


@dataclass(frozen=True)
class HFRunTokenizer:
    """A run's HuggingFaceTokenizer directory; ``size`` is len(tokenizer), ``eod_id`` its eos id."""

    model_dir: Path

    @property
    def source(self) -> str:
        return str(self.model_dir)

    @cached_property
    def _loaded(self) -> Any:
        from trainer.data.hf_tokenizer import load_hf_tokenizer
        from trainer.data.tokenizer import TokenizerFileError

        try:
            return load_hf_tokenizer(self.model_dir)
        except TokenizerFileError as e:
            raise CheckpointError(f"{e}; or pass --tokenizer-model") from e

    @property
    def size(self) -> int:
        return self._loaded.vocab_size

    @property
    def eod_id(self) -> int:
        return self._loaded.eod_id

    def encode(self, text: str) -> list[int]:
        return self._loaded.encode(text)


AnyRunTokenizer = RunTokenizer | HFRunTokenizer


def _hf_from_args(args: Any) -> HFRunTokenizer | None:
    nested = arg(args, "tokenizer", None)
    # Megatron's args name it tokenizer_model; a Slipway config dict's tokenizer section, model.
    places = ((args, "tokenizer_model", "tokenizer_type"),
              (nested if isinstance(nested, dict) else None, "model", "type"))
    for source, key, type_key in places:
        model = arg(source, key)
        if model and arg(source, type_key) == HF_TOKENIZER_TYPE:
            return HFRunTokenizer(Path(model))
    return None


def find_tokenizer(args: Any, search_dirs: list[Path], vocab_file: Path | None = None,
                   merge_file: Path | None = None, tokenizer_model: Path | None = None
                   ) -> AnyRunTokenizer | None:
    """The explicit files or directory, else what args name, else vocab.json/merges.txt in one of
    ``search_dirs``."""
    if tokenizer_model:
        return HFRunTokenizer(Path(tokenizer_model))
    if (hf := _hf_from_args(args)) is not None and not (vocab_file or merge_file):
        return hf
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


def _save_hf_dir(tok: HFRunTokenizer, out_dir: Path, config: Any = None) -> Any:
    """Copy the tokenizer's files (the model's config.json is the converter's own) and check the copy,
    loaded as users will load it: with the model's ``config`` (not in ``out_dir`` yet while unverified)."""
    from transformers import AutoTokenizer

    from trainer.data.hf_tokenizer import tokenizer_files

    for path in tokenizer_files(tok.model_dir):
        if path.name != "config.json":
            shutil.copyfile(path, out_dir / path.name)
    copy = AutoTokenizer.from_pretrained(str(out_dir), config=config)
    probe = f"def f(x):\n    return x  # é {EOD_TOKEN}"
    if (len(copy), copy.eos_token_id, copy(probe).input_ids) != (tok.size, tok.eod_id, tok.encode(probe)):
        raise CheckpointError(f"the tokenizer copied from {tok.model_dir} into {out_dir} loads differently "
                              "there (the model's config.json picks another tokenizer class?): give the "
                              "tokenizer directory a tokenizer_config.json with its tokenizer_class")
    return copy


def save_tokenizer(tok: AnyRunTokenizer, out_dir: Path, model_max_length: int, config: Any = None) -> Any:
    """Write the run's tokenizer into ``out_dir`` (GPT-2 BPE: all of TOKENIZER_FILES); returns the HF
    tokenizer. ``config``: the model's, when ``out_dir`` has no config.json yet."""
    if isinstance(tok, HFRunTokenizer):
        return _save_hf_dir(tok, out_dir, config)
    hf_tok = build_hf_tokenizer(tok, model_max_length)
    hf_tok.save_pretrained(str(out_dir))
    shutil.copyfile(tok.vocab_file, out_dir / "vocab.json")
    shutil.copyfile(tok.merge_file, out_dir / "merges.txt")
    # Newer transformers fold this into tokenizer_config.json; older readers still look for it.
    special = {k: EOD_TOKEN for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return hf_tok
