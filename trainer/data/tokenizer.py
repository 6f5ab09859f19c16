"""GPT-2 byte-level BPE from vocab.json + merges.txt, with Megatron's ``GPT2BPETokenizer`` semantics.

Two backends give the same ids:

- ``tiktoken`` (fast, ~5× HF): an ``Encoding`` built from the same files, used only when
  :mod:`trainer.data.bpe_equivalence` proves at load time that it reproduces GPT-2 BPE on them;
- ``hf``: HF ``tokenizers`` BPE + ByteLevel pre-tokenizer, the fallback.

Megatron semantics kept: ``vocab_size`` is the number of vocab.json entries (not padded), ``eod_id`` is
``vocab["<|endoftext|>"]``, and a literal ``<|endoftext|>`` in the text is encoded as ordinary text.
merges.txt is read as Megatron reads it (first line is the ``#version`` header, the file ends with a
newline); a file where Megatron would silently drop a merge is refused with the reason.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal, get_args

import numpy as np

from trainer.data.bpe_equivalence import tiktoken_ranks, token_bytes
from trainer.log import get_logger

log = get_logger(__name__)

EOD_TOKEN = "<|endoftext|>"
# GPT-2's pre-tokenizer (OpenAI encoder.py, Megatron gpt2_tokenization.py, HF ByteLevel use_regex=True).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
Backend = Literal["auto", "tiktoken", "hf"]
BACKENDS: tuple[str, ...] = get_args(Backend)


class TokenizerFileError(ValueError):
    """vocab.json or merges.txt is unusable; the message names the file and the problem."""


def read_vocab(vocab_file: str | Path) -> dict[str, int]:
    """vocab.json as a dict, checked to be a JSON object of string → int."""
    try:
        vocab = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerFileError(f"{vocab_file}: cannot read vocab.json: {e}") from e
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise TokenizerFileError(f"{vocab_file}: expected a JSON object mapping token strings to integer ids")
    return vocab


def read_merges(merge_file: str | Path) -> list[tuple[str, str]]:
    """merges.txt as (left, right) pairs in rank order, read the way Megatron reads it."""
    try:
        text = Path(merge_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerFileError(f"{merge_file}: cannot read merges.txt: {e}") from e
    lines = text.split("\n")
    # Megatron keeps lines[1:-1]: it drops line 1 unconditionally and whatever follows the last newline.
    if not lines[0].startswith("#version"):
        raise TokenizerFileError(f"{merge_file}: line 1 is {lines[0][:40]!r}, not a '#version' header; "
                                 "Megatron would silently drop it as the header. Add '#version: 0.2' first.")
    if lines[-1] != "":
        raise TokenizerFileError(f"{merge_file}: does not end with a newline; Megatron would silently drop "
                                 f"the last merge {lines[-1]!r}. Append a newline.")
    merges = []
    for number, line in enumerate(lines[1:-1], start=2):
        parts = line.split()
        if len(parts) != 2:
            raise TokenizerFileError(f"{merge_file}: line {number} is {line!r}, expected two tokens "
                                     "separated by a space")
        merges.append((parts[0], parts[1]))
    return merges


def check_pair(vocab: dict[str, int], merges: list[tuple[str, str]], vocab_file: str | Path,
               merge_file: str | Path) -> None:
    """The merges belong to this vocabulary: both parts of every merge and their result are tokens of it
    (else HF tokenizers fails later with a bare "Token ... out of vocabulary" that names neither file)."""
    for number, (left, right) in enumerate(merges, start=2):
        missing = [tok for tok in (left, right, left + right) if tok not in vocab]
        if missing:
            raise TokenizerFileError(
                f"{merge_file} does not belong to {vocab_file}: line {number} merges {left!r} + {right!r} "
                f"but {missing[0]!r} is not in the vocabulary. Use the vocab.json and merges.txt of one "
                "tokenizer")


@dataclass(frozen=True)
class TokenizerSpec:
    """Everything needed to rebuild the same tokenizer in another process (picklable, small)."""

    vocab_file: str
    merge_file: str
    backend: Backend = "auto"


class GPT2BPETokenizer:
    """Megatron's ``GPT2BPETokenizer`` face over the tiktoken or HF backend (see module docstring)."""

    def __init__(self, spec: TokenizerSpec) -> None:
        if spec.backend not in BACKENDS:
            raise ValueError(f"backend={spec.backend!r}: use 'auto', 'tiktoken' or 'hf'")
        self.spec = spec
        vocab = read_vocab(spec.vocab_file)
        merges = read_merges(spec.merge_file)
        check_pair(vocab, merges, spec.vocab_file, spec.merge_file)
        if EOD_TOKEN not in vocab:
            raise TokenizerFileError(f"{spec.vocab_file}: no {EOD_TOKEN!r} entry; Megatron's "
                                     "GPT2BPETokenizer needs it as the end-of-document id")
        self.vocab_size: int = len(vocab)
        self.eod_id: int = vocab[EOD_TOKEN]
        self._vocab = vocab
        self.fallback_reasons: list[str] = []
        self._tiktoken = self._hf = None
        if spec.backend != "hf":
            report = tiktoken_ranks(vocab, merges)
            if report.equivalent:
                self._tiktoken = _build_tiktoken(report.ranks)
            elif spec.backend == "tiktoken":
                raise TokenizerFileError("tiktoken backend requested but not provably equal to GPT-2 BPE "
                                         f"on {spec.vocab_file}/{spec.merge_file}: "
                                         + "; ".join(report.problems))
            else:
                self.fallback_reasons = report.problems
                log.warning("tokenizer: using HF tokenizers (slower): tiktoken is not provably equivalent "
                            "on these files: %s", "; ".join(report.problems[:3]))
        if self._tiktoken is None:
            self._hf = _build_hf(vocab, merges)
        self.backend: str = "tiktoken" if self._tiktoken is not None else "hf"

    @property
    def eod(self) -> int:
        """Megatron's name for :attr:`eod_id`."""
        return self.eod_id

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it are ordinary text."""
        if self._tiktoken is not None:
            return self._tiktoken.encode_ordinary(text)
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_to_numpy(self, text: str) -> np.ndarray:
        """Like :meth:`encode`, as a uint32 array."""
        # Not tiktoken's own encode_to_numpy: its special-token-aware encoder costs ~1.4x the CPU of
        # encode_ordinary on Python source, more than the list it avoids (bench/README.md, preprocessing).
        return np.asarray(self.encode(text), dtype=np.uint32)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` of each text, in order."""
        if self._tiktoken is not None:
            return [self._tiktoken.encode_ordinary(t) for t in texts]
        return [e.ids for e in self._hf.encode_batch(list(texts), add_special_tokens=False)]

    @cached_property
    def _id_to_bytes(self) -> dict[int, bytes]:
        # Built on first decode only: preprocess workers never decode.
        return {i: token_bytes(t) or t.encode("utf-8") for t, i in self._vocab.items()}

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids`` (invalid UTF-8 across token boundaries becomes U+FFFD, as in Megatron)."""
        try:
            raw = b"".join(self._id_to_bytes[int(i)] for i in ids)
        except KeyError as e:
            raise ValueError(f"decode: id {e.args[0]} is not in {self.spec.vocab_file}") from None
        return raw.decode("utf-8", errors="replace")


def _build_tiktoken(ranks: dict[bytes, int]):
    import tiktoken

    return tiktoken.Encoding("slipway_gpt2_bpe", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                             special_tokens={})


def _build_hf(vocab: dict[str, int], merges: list[tuple[str, str]]):
    from tokenizers import Tokenizer, models, pre_tokenizers

    # No added/special tokens: a literal <|endoftext|> must stay ordinary text (Megatron semantics).
    model = models.BPE(vocab=vocab, merges=merges, fuse_unk=False)
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return tok


_CACHE: dict[tuple, GPT2BPETokenizer] = {}


def load_gpt2_bpe(vocab_file: str | Path, merge_file: str | Path,
                  backend: Backend = "auto") -> GPT2BPETokenizer:
    """The tokenizer for these files (cached per process: worker processes reuse a forked parent's)."""
    spec = TokenizerSpec(str(Path(vocab_file).resolve()), str(Path(merge_file).resolve()), backend)
    # Keyed by the files' identity too, so rewritten files are never served from a stale entry.
    key = (spec, *(_identity(p) for p in (spec.vocab_file, spec.merge_file)))
    if key not in _CACHE:
        _CACHE[key] = GPT2BPETokenizer(spec)
    return _CACHE[key]


def _identity(path: str) -> tuple[int, int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return (0, 0, 0)  # GPT2BPETokenizer reports the missing file with its name
    return (st.st_ino, st.st_size, st.st_mtime_ns)
