"""A Hugging Face tokenizer directory (``tokenizer.json``) with Megatron's ``HuggingFaceTokenizer`` semantics.

Megatron-LM's ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR`` loads
``transformers.AutoTokenizer.from_pretrained(DIR)`` and, per text, keeps ``tokenizer(text).input_ids``:
special tokens the tokenizer's post-processor adds (a BOS, say) are part of every document, and special
token strings inside the text are parsed as those tokens. Its ``vocab_size`` is ``len(tokenizer)`` (added
tokens included) and its end-of-document id (``eod``, what ``--append-eod`` appends) is the tokenizer's
``eos_token_id``. Slipway goes through the same calls, so the ids are the same by construction; what it
adds is refusing, with the file and the fix, a directory without ``tokenizer.json`` or without an eos
token (Megatron would append ``None`` and crash mid-run, or train without document boundaries).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.data.tokenizer import GPT2BPETokenizer, TokenizerFileError, TokenizerSpec, load_gpt2_bpe

HF_TOKENIZER_TYPE = "HuggingFaceTokenizer"
TOKENIZER_TYPES = ("GPT2BPETokenizer", HF_TOKENIZER_TYPE)  # Megatron's names of the two Slipway reads
# The files of a tokenizer directory that AutoTokenizer reads (config.json picks the class when
# tokenizer_config.json does not); they make its content hash and are what travels into hf/.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                      "added_tokens.json", "vocab.json", "merges.txt", "config.json")


@dataclass(frozen=True)
class HFTokenizerSpec:
    """A tokenizer directory, small and picklable for worker processes."""

    model_dir: str


def tokenizer_json(model_dir: str | Path) -> Path:
    """``model_dir/tokenizer.json``, or an error that says which directory lacks it and what to do."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        what = "is not a directory" if not Path(model_dir).is_dir() else "has no tokenizer.json"
        raise TokenizerFileError(
            f"tokenizer model {model_dir} {what}: HuggingFaceTokenizer needs a directory holding a "
            "tokenizer.json (a fast tokenizer). Save one there with tokenizer.save_pretrained(DIR), or "
            "point --tokenizer-model (tokenizer.model in launch.py) at such a directory")
    return path


def tokenizer_files(model_dir: str | Path) -> list[Path]:
    """The :data:`HF_TOKENIZER_FILES` present in ``model_dir`` (tokenizer.json is required)."""
    tokenizer_json(model_dir)
    return [Path(model_dir) / n for n in HF_TOKENIZER_FILES if (Path(model_dir) / n).is_file()]


def content_hash(model_dir: str | Path) -> str:
    """sha256 over the names and bytes of the tokenizer's files: equal exactly when the ids can be."""
    h = hashlib.sha256()
    for path in tokenizer_files(model_dir):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


class HuggingFaceTokenizer:
    """Megatron's ``HuggingFaceTokenizer`` face (see module docstring), shaped like GPT2BPETokenizer."""

    backend = "hf"

    def __init__(self, spec: HFTokenizerSpec) -> None:
        from transformers import AutoTokenizer

        self.spec = spec
        where = tokenizer_json(spec.model_dir)
        try:
            self._tok = AutoTokenizer.from_pretrained(spec.model_dir)
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise TokenizerFileError(f"{where}: transformers.AutoTokenizer cannot load it: {e}. Check that "
                                     "the file was written by tokenizer.save_pretrained") from e
        if self._tok.eos_token_id is None:
            raise TokenizerFileError(
                f"{spec.model_dir}: the tokenizer has no eos token, and Megatron's HuggingFaceTokenizer "
                "uses eos_token_id as the end-of-document id (--append-eod, and training's document "
                'boundaries). Set "eos_token" in its tokenizer_config.json (e.g. "<|endoftext|>", a token '
                "of tokenizer.json) or save it with tokenizer.eos_token set")
        self.vocab_size: int = len(self._tok)
        self.eod_id: int = int(self._tok.eos_token_id)
        self.fallback_reasons: list[str] = []

    @property
    def eod(self) -> int:
        """Megatron's name for :attr:`eod_id`."""
        return self.eod_id

    def encode(self, text: str) -> list[int]:
        """``tokenizer(text).input_ids``, as Megatron: post-processor tokens included."""
        return self._tok(text).input_ids

    def encode_to_numpy(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.uint32)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in ids])


AnySpec = TokenizerSpec | HFTokenizerSpec
AnyTokenizer = GPT2BPETokenizer | HuggingFaceTokenizer
_CACHE: dict[tuple, HuggingFaceTokenizer] = {}


def load_hf_tokenizer(model_dir: str | Path) -> HuggingFaceTokenizer:
    """The tokenizer of ``model_dir`` (cached per process, keyed by tokenizer.json's identity too)."""
    spec = HFTokenizerSpec(str(Path(model_dir).resolve()))
    path = tokenizer_json(spec.model_dir)
    st = os.stat(path)
    key = (spec, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _CACHE:
        _CACHE[key] = HuggingFaceTokenizer(spec)
    return _CACHE[key]


def load_spec(spec: AnySpec) -> AnyTokenizer:
    """The tokenizer a spec names (what worker processes rebuild)."""
    if isinstance(spec, HFTokenizerSpec):
        return load_hf_tokenizer(spec.model_dir)
    return load_gpt2_bpe(spec.vocab_file, spec.merge_file, spec.backend)
