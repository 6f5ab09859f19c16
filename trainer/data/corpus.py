"""Corpus builder: real Python source files → JSONL with ``content`` and ``path`` fields.

The embedded default corpus is the running interpreter's standard library (~1,800 files, ~31 MB): real
code nobody here wrote, the same kind of data as CodeParrot's GitHub Python files. Order is deterministic
(roots in the given order, then paths sorted bytewise within each root), so the same interpreter gives the
same JSONL byte for byte.

CLI: ``python -m trainer.data.corpus --output corpus.jsonl [--root DIR ...] [--max-files N] [--max-bytes B]
[--exclude-tests]``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import sysconfig
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from trainer.cli import Flags, add_dataclass_args, from_args
from trainer.data.corpus_config import CorpusConfig, CorpusRun
from trainer.log import get_logger
from trainer.run_files import CORPUS_FILE

log = get_logger("trainer.data.corpus")

# Third-party packages live under the stdlib folder; they are not the standard library.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_TEST_DIRS = frozenset({"test", "tests", "idle_test", "unittests"})


def default_roots() -> list[str]:
    """The running interpreter's standard library folder."""
    return [sysconfig.get_paths()["stdlib"]]


def check_roots(roots: list[str]) -> list[str]:
    """``roots``, or the standard library when empty; each must be an existing folder."""
    roots = list(roots) or default_roots()
    for root in roots:
        if not Path(root).is_dir():
            raise ValueError(f"data.corpus.roots: {root!r} is not a folder; pass existing folders")
    return roots


@dataclass
class CorpusSummary:
    """What :func:`build_corpus` wrote."""

    output: str
    files: int
    bytes: int
    """UTF-8 bytes of source text (the ``content`` fields), not of the JSONL."""
    undecodable: list[str]
    """Files skipped because their bytes do not decode in their declared (or default UTF-8) encoding."""


def iter_source_files(roots: list[str], exclude_tests: bool = False) -> Iterator[Path]:
    """``*.py`` files under ``roots`` in a deterministic order: roots as given, then sorted paths."""
    for root in roots:
        found: list[str] = []
        for dirpath, dirnames, filenames in os.walk(root):
            skip = _SKIP_DIRS | (_TEST_DIRS if exclude_tests else frozenset())
            dirnames[:] = [d for d in dirnames if d not in skip]
            found.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
        # Sorting by the encoded path makes the order independent of locale and filesystem.
        for path in sorted(found, key=os.fsencode):
            if os.path.isfile(path):
                yield Path(path)


def read_source(path: Path) -> str | None:
    """The file's text decoded the way Python itself would (PEP 263 coding cookie, else UTF-8), or None."""
    raw = path.read_bytes()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
        text = raw.decode(encoding)
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return None
    # detect_encoding reports "utf-8-sig" for a BOM; decoding with it strips the BOM, as Python does.
    return text


def iter_documents(config: CorpusConfig, skipped: list[str] | None = None) -> Iterator[dict[str, str]]:
    """``{"content", "path"}`` records, honouring the file and byte limits. ``path`` is root-relative.

    Files that do not decode are left out and, when ``skipped`` is given, appended to it.
    """
    files = total = 0
    for root in check_roots(config.roots):
        for path in iter_source_files([root], config.exclude_tests):
            if config.max_files is not None and files >= config.max_files:
                return
            text = read_source(path)
            if text is None:
                log.warning("corpus: skipped %s (does not decode in its declared encoding)", path)
                if skipped is not None:
                    skipped.append(str(path))
                continue
            size = len(text.encode("utf-8"))
            if config.max_bytes is not None and total + size > config.max_bytes:
                return
            files += 1
            total += size
            yield {"content": text, "path": str(path.relative_to(root))}


def build_corpus(config: CorpusConfig, output: str) -> CorpusSummary:
    """Write the JSONL to ``output`` (atomically: a temporary name renamed into place) and return what
    was written."""
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".partial-{os.getpid()}")
    files = total = 0
    undecodable: list[str] = []
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for doc in iter_documents(config, undecodable):
                # ensure_ascii keeps the file 7-bit clean: any reader, any locale, no encoding questions.
                f.write(json.dumps(doc) + "\n")
                files += 1
                total += len(doc["content"].encode("utf-8"))
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    log.info("corpus: wrote %d files, %.1f MB of source to %s", files, total / 1e6, out)
    return CorpusSummary(str(out), files, total, undecodable)


# --root (repeated) for the roots list, as the command line has always spelt it.
FLAGS = (Flags(CorpusConfig, rename={"roots": "root"}, options={"roots": {"action": "append"}}),)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer.data.corpus", description=__doc__.split("\n")[0])
    parser.add_argument("--output", required=True, help="JSONL file to write")
    add_dataclass_args(parser, FLAGS[0])
    return parser


def run_corpus(job: CorpusRun) -> dict:
    """The corpus stage: ``<output_dir>/corpus.jsonl``, then the BPE trained on it when asked. Returns
    what it wrote (the stage's ``_COMPLETE`` record)."""
    from trainer.data.train_tokenizer import TokenizerTrainConfig, train_tokenizer

    corpus = os.path.join(job.output_dir, CORPUS_FILE)
    summary = build_corpus(job.corpus, corpus)
    out: dict = {"corpus": corpus, "files": summary.files, "bytes": summary.bytes}
    if job.vocab_size:
        vocab, merges = train_tokenizer(TokenizerTrainConfig(
            inputs=[corpus], output_dir=job.output_dir, vocab_size=job.vocab_size, json_key=job.json_key))
        out.update(vocab_file=str(vocab), merge_file=str(merges))
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = from_args(FLAGS[0], args)
    summary = build_corpus(config, args.output)
    sys.stdout.write(f"{summary.files} files, {summary.bytes / 1e6:.1f} MB -> {summary.output}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
