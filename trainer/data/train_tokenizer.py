"""Train a GPT-2-style byte-level BPE tokenizer on a JSONL corpus (as CodeParrot retrained GPT-2's).

Writes ``vocab.json`` and ``merges.txt`` with ``<|endoftext|>`` as the first special token (id 0), then
the 256 byte tokens, then one token per merge in merge order — the layout :mod:`trainer.data.tokenizer`
can prove tiktoken-equivalent. Deterministic: same corpus and settings give the same files byte for byte.

CLI: ``python -m trainer.data.train_tokenizer --input corpus.jsonl --output-dir tok/ [--vocab-size 32768]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from trainer.cli import Flags, add_dataclass_args, from_args
from trainer.data.tokenizer import EOD_TOKEN
from trainer.log import get_logger
from trainer.run_files import DEFAULT_JSON_KEY, MERGE_FILE, VOCAB_FILE

log = get_logger("trainer.data.train_tokenizer")

_MIN_VOCAB = 257  # <|endoftext|> + 256 byte tokens


@dataclass
class TokenizerTrainConfig:
    """What to train on and what to produce."""

    inputs: list[str]
    """JSONL files (one JSON object per line), read in this order."""
    output_dir: str
    """Folder that receives vocab.json and merges.txt (created if missing; existing files replaced)."""
    vocab_size: int = 32768
    """Entries in vocab.json including <|endoftext|> (CodeParrot: 32768, which stays uint16 on disk)."""
    json_key: str = DEFAULT_JSON_KEY
    """Field holding the text."""
    min_frequency: int = 2
    """A pair must occur this often to be merged."""
    max_documents: int | None = None
    """Train on the first N documents only (None: all)."""

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ValueError("TokenizerTrainConfig.inputs is empty: give at least one JSONL file")
        for path in self.inputs:
            if not Path(path).is_file():
                raise ValueError(f"TokenizerTrainConfig.inputs: {path!r} does not exist")
        if self.vocab_size < _MIN_VOCAB:
            raise ValueError(f"TokenizerTrainConfig.vocab_size={self.vocab_size}: must be ≥ {_MIN_VOCAB} "
                             "(<|endoftext|> plus the 256 byte tokens)")
        if self.min_frequency < 1:
            raise ValueError(f"TokenizerTrainConfig.min_frequency={self.min_frequency}: must be ≥ 1")
        if self.max_documents is not None and self.max_documents <= 0:
            raise ValueError(f"TokenizerTrainConfig.max_documents={self.max_documents}: positive or None")


def iter_texts(config: TokenizerTrainConfig) -> Iterator[str]:
    """The training texts, in file and line order; a bad line is an error naming file and line."""
    count = 0
    for path in config.inputs:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if config.max_documents is not None and count >= config.max_documents:
                    return
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)[config.json_key]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{path}:{number}: no usable {config.json_key!r} field ({e})") from e
                if not isinstance(text, str):
                    raise ValueError(f"{path}:{number}: {config.json_key!r} is {type(text).__name__}, "
                                     "expected a string")
                count += 1
                yield text


def train_tokenizer(config: TokenizerTrainConfig) -> tuple[Path, Path]:
    """Train and write (vocab.json, merges.txt); both appear together, never half-written."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    # ByteLevelBPETokenizer.train_from_iterator seeds the alphabet with all 256 byte characters and puts
    # the special tokens first, so <|endoftext|> is id 0 and ids follow merge order.
    tok.train_from_iterator(iter_texts(config), vocab_size=config.vocab_size,
                            min_frequency=config.min_frequency, special_tokens=[EOD_TOKEN],
                            show_progress=False)
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".train-") as tmp:
        tok.save_model(tmp)
        # vocab.json last: a reader that finds it also finds the merges.txt written with it.
        os.replace(Path(tmp) / MERGE_FILE, out / MERGE_FILE)
        os.replace(Path(tmp) / VOCAB_FILE, out / VOCAB_FILE)
    size = tok.get_vocab_size()
    if size < config.vocab_size:
        log.warning("tokenizer: corpus supports only %d tokens (asked for %d)", size, config.vocab_size)
    log.info("tokenizer: wrote %s and %s (%d tokens)", out / VOCAB_FILE, out / MERGE_FILE, size)
    return out / VOCAB_FILE, out / MERGE_FILE


FLAGS = (Flags(TokenizerTrainConfig, rename={"inputs": "input"}),)  # --input, as preprocess spells it


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer.data.train_tokenizer",
                                     description="Train a GPT-2-style byte-level BPE on JSONL text.")
    add_dataclass_args(parser, FLAGS[0])
    return parser


def main(argv: list[str] | None = None) -> int:
    vocab, merges = train_tokenizer(from_args(FLAGS[0], build_parser().parse_args(argv)))
    sys.stdout.write(f"{vocab}\n{merges}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
