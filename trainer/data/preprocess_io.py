"""Preprocess internals: input discovery, newline-aligned chunks, and per-chunk parse + tokenize.

A chunk is ~1 MiB of whole JSONL lines with the number of its first line; a worker turns it into, per JSON
key, the token ids back to back plus one length per document (0 = empty document), so the writer appends
a whole chunk with one numpy call. Bad lines are classified here (reasons below) with file and line.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trainer.data.hf_tokenizer import AnySpec, AnyTokenizer, load_spec
from trainer.disk import free_bytes, short_write, size

# What a bad line does: fail stops at the first one; skip drops it and counts it by reason.
ON_ERROR = ("fail", "skip")
# Reason keys (stable: they appear in the JSON summary) → words for messages.
REASONS = {
    "invalid_json": "invalid JSON",
    "missing_key": "missing key",
    "non_string": "non-string value",
    "invalid_utf8": "invalid UTF-8",
}


class InputError(ValueError):
    """Input files cannot be found or read (not a per-line problem)."""


def resolve_inputs(pattern: str) -> list[str]:
    """``pattern`` as a file, or the sorted files a glob matches (deterministic order)."""
    if os.path.isfile(pattern):
        return [pattern]
    if os.path.isdir(pattern):
        raise InputError(f"input {pattern!r} is a directory, not a JSONL file: give its files "
                         f"(--input '{pattern.rstrip('/')}/*.jsonl'; data.paths in launch.py)")
    files = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not files:
        raise InputError(f"input {pattern!r} (--input; data.paths in launch.py): no such file, and as a "
                         "glob it matches no files")
    return files


@dataclass
class Chunk:
    """Whole lines of one input file."""

    file: str
    first_line: int
    data: bytes
    progress_bytes: int
    """Bytes of the input *file* (compressed for .gz) consumed once this chunk is done."""


def iter_chunks(files: list[str], chunk_bytes: int) -> Iterator[Chunk]:
    """Newline-aligned chunks of every file in order; a final line without newline is kept."""
    done = 0
    for path in files:
        with open(path, "rb") as raw:
            stream = gzip.GzipFile(fileobj=raw, mode="rb") if path.endswith(".gz") else raw
            line = 1
            pending: list[bytes] = []  # the start of a line not yet ended (a list: long lines stay linear)
            while True:
                try:
                    block = stream.read(chunk_bytes)
                except (OSError, EOFError) as e:  # BadGzipFile is an OSError
                    raise InputError(f"{path}: cannot read past line {line}: {e}") from e
                if not block:
                    if pending:
                        yield Chunk(path, line, b"".join(pending), done + raw.tell())
                    break
                cut = block.rfind(b"\n") + 1
                if cut == 0:
                    pending.append(block)
                    continue
                data = b"".join([*pending, block[:cut]])
                pending = [block[cut:]] if cut < len(block) else []
                yield Chunk(path, line, data, done + raw.tell())
                line += data.count(b"\n")
        done += os.path.getsize(path)


@dataclass
class BadLine:
    file: str
    line: int
    reason: str
    detail: str

    def message(self) -> str:
        return f"{self.file}:{self.line}: {REASONS[self.reason]}: {self.detail}"


@dataclass
class ChunkResult:
    """One chunk, encoded. ``tokens[k]``/``doc_lengths[k]`` per JSON key, in input order."""

    tokens: dict[str, np.ndarray]
    doc_lengths: dict[str, np.ndarray]
    documents: int
    input_bytes: int
    blank_lines: int = 0
    bad: list[BadLine] = field(default_factory=list)
    """Lines dropped (skip mode), or the one line that stops the run (fail mode)."""


@dataclass(frozen=True)
class EncodeSettings:
    """What every worker needs to encode a chunk (small and picklable)."""

    tokenizer: AnySpec
    json_keys: tuple[str, ...]
    append_eod: bool
    skip_bad: bool
    dtype: str


_TOKENIZER: AnyTokenizer | None = None


def init_worker(spec: AnySpec, parent_pid: int) -> None:
    """Pool initializer: Ctrl-C is the parent's to handle, die with the parent, load the tokenizer once."""
    import signal

    global _TOKENIZER
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    _TOKENIZER = load_spec(spec)


def _die_with_parent(parent_pid: int) -> None:
    """A forked worker holds its own copy of the task pipe, so it never sees EOF when a killed parent
    vanishes: without this, ``kill -9`` of a preprocess job leaves its workers waiting forever."""
    import signal
    import sys
    import threading

    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)

    def watch() -> None:  # portable fallback (and belt and braces on Linux)
        while os.getppid() == parent_pid:
            threading.Event().wait(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _lines(chunk: Chunk) -> Iterator[tuple[int, str | BadLine]]:
    """(line number, text or BadLine) for each line; decodes the whole chunk at once when it can."""
    raw_lines = chunk.data.split(b"\n")
    if raw_lines and raw_lines[-1] == b"":
        raw_lines.pop()
    try:
        texts = chunk.data.decode("utf-8").split("\n")
    except UnicodeDecodeError:
        texts = None
    for i, raw in enumerate(raw_lines):
        number = chunk.first_line + i
        if texts is not None:
            yield number, texts[i]
            continue
        try:
            yield number, raw.decode("utf-8")
        except UnicodeDecodeError as e:
            detail = f"byte 0x{raw[e.start]:02x} at byte offset {e.start} of the line ({e.reason})"
            yield number, BadLine(chunk.file, number, "invalid_utf8", detail)


def _parse(line: str, file: str, number: int, keys: tuple[str, ...], check_surrogates: bool):
    """The texts of ``keys`` in one JSON line, or a BadLine."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return BadLine(file, number, "invalid_json", f"{e.msg} (column {e.colno})")
    if not isinstance(obj, dict):
        return BadLine(file, number, "invalid_json",
                       f"top-level value is {type(obj).__name__}, expected an object")
    texts = []
    for key in keys:
        if key not in obj:
            return BadLine(file, number, "missing_key", f"no {key!r} field (fields: {sorted(obj)[:8]})")
        value = obj[key]
        if not isinstance(value, str):
            return BadLine(file, number, "non_string",
                           f"{key!r} is {type(value).__name__}, expected a string")
        if check_surrogates:
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                return BadLine(file, number, "invalid_utf8", f"{key!r} has an unpaired surrogate escape "
                               f"\\u{ord(value[e.start]):04x} at character {e.start}")
        texts.append(value)
    return texts


def encode_chunk(chunk: Chunk, settings: EncodeSettings) -> ChunkResult:
    """Parse and tokenize one chunk (runs in a worker process)."""
    tok = _TOKENIZER or load_spec(settings.tokenizer)
    keys = settings.json_keys
    # Token ids of the whole chunk per key, back to back. tiktoken's encode_ordinary (a list) extended into
    # a C array is ~30% less CPU than its encode_to_numpy (whose special-token-aware encoder is slower).
    ids_out: dict[str, array] = {k: array("I") for k in keys}
    lengths: dict[str, list[int]] = {k: [] for k in keys}
    eod = tok.eod_id
    # Lone surrogates can only come from \uD8xx..\uDFxx escapes; look for them only where those occur.
    check_surrogates = b"\\ud" in chunk.data or b"\\uD" in chunk.data
    result = ChunkResult({}, {}, 0, len(chunk.data))
    for number, line in _lines(chunk):
        if isinstance(line, str):
            if not line.strip():
                result.blank_lines += 1
                continue
            line = _parse(line, chunk.file, number, keys, check_surrogates)
        if isinstance(line, BadLine):
            result.bad.append(line)
            if not settings.skip_bad:
                break
            continue
        for key, text in zip(keys, line, strict=True):
            ids = tok.encode(text)
            out = ids_out[key]
            out.extend(ids)
            # Megatron appends EOD only to non-empty documents: an empty one stays zero-sequence.
            if settings.append_eod and ids:
                out.append(eod)
                lengths[key].append(len(ids) + 1)
            else:
                lengths[key].append(len(ids))
        result.documents += 1
    for key in keys:
        result.tokens[key] = np.frombuffer(ids_out[key], dtype=np.uintc).astype(settings.dtype)
        result.doc_lengths[key] = np.asarray(lengths[key], dtype=np.int64)
    return result


def file_size_total(files: list[str]) -> int:
    return sum(Path(f).stat().st_size for f in files)


class DiskFullError(OSError):
    """The output's filesystem filled up; the message names the folder, the bytes needed and free."""

    def __str__(self) -> str:
        return str(self.args[0])


def disk_full(err: OSError, temps: dict[str, tuple[str, str]], consumed: int, total: int) -> DiskFullError:
    """What the job needs (extrapolated from the bytes written for the input read so far) and what is free
    once its temporary files are removed (as they are next)."""
    on_disk = sum(os.path.getsize(p) for pair in temps.values() for p in pair if os.path.exists(p))
    written = on_disk + (short_write(err) or 0)  # plus what the failed write could not put down
    needed = max(written, written * total // consumed) if consumed else written
    folder = os.path.dirname(os.path.abspath(next(iter(temps.values()))[0]))
    return DiskFullError(
        f"{folder}: no space left for the preprocessed data (the write failed: {err}): the outputs need "
        f"about {size(needed)} for {size(total)} of input (extrapolated from {size(written)} for the first "
        f"{size(consumed)}), {size(free_bytes(folder) + on_disk)} are free there. Nothing was published "
        "(temporary files removed). Free space or put the output on a larger filesystem (data.cache_dir in "
        "launch.py), then run again")
