"""Megatron's memory-mapped indexed dataset: ``{prefix}.bin`` (token ids) + ``{prefix}.idx`` (index).

Byte-compatible with Megatron-LM's ``MMapIndexedDataset`` / ``IndexedDatasetBuilder`` (formats.md §1):
``.idx`` = magic ``MMIDIDX\\0\\0``, version 1 (u64), dtype code (u8), N sequences (u64), M = documents + 1
(u64), N int32 sequence lengths, N int64 byte offsets into ``.bin``, M int64 document boundaries (in
sequences). The reader validates all of it — and that ``.bin`` is exactly as long as the index says — so a
truncated or corrupt pair fails at open with the file and the problem, never later inside training.

Public API: :class:`IndexedDataset` (reader), :class:`IndexedDatasetBuilder` (writer),
:func:`merge_datasets`, :func:`best_fitting_dtype`, :func:`publish` (atomic rename of finished pairs).
"""

from __future__ import annotations

import os
import shutil
import signal
import struct
import tempfile
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from trainer.disk import as_open_would

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34  # magic 9 + version 8 + dtype 1 + N 8 + M 8
# Megatron's DType enum (current Megatron: 7 = float32, 8 = uint16). Explicit little-endian on disk.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype("u1"), 2: np.dtype("i1"), 3: np.dtype("<i2"), 4: np.dtype("<i4"),
    5: np.dtype("<i8"), 6: np.dtype("<f8"), 7: np.dtype("<f4"), 8: np.dtype("<u2"),
}
_CODE_OF = {dt: code for code, dt in DTYPE_CODES.items()}


class IndexedDatasetError(ValueError):
    """A ``.bin``/``.idx`` pair is missing, truncated or inconsistent; the message names file and problem."""


def best_fitting_dtype(vocab_size: int) -> np.dtype:
    """Megatron's rule: uint16 when the vocab (entries, not padded) has < 65500 ids, else int32."""
    return np.dtype("<u2") if vocab_size < 65500 else np.dtype("<i4")


def dtype_code(dtype: np.dtype | type) -> int:
    dt = np.dtype(dtype).newbyteorder("<")
    if dt not in _CODE_OF:
        raise ValueError(f"dtype {dt} has no Megatron code; use one of {sorted(map(str, _CODE_OF))}")
    return _CODE_OF[dt]


def data_file_path(prefix: str | Path) -> str:
    return f"{prefix}.bin"


def index_file_path(prefix: str | Path) -> str:
    return f"{prefix}.idx"


class IndexedDatasetBuilder:
    """Streams token ids into ``bin_path``; :meth:`finalize` writes the index (Megatron's builder)."""

    def __init__(self, bin_path: str | Path, dtype: np.dtype | type = np.uint16) -> None:
        self.dtype = np.dtype(dtype).newbyteorder("<")
        dtype_code(self.dtype)  # refuse dtypes the format cannot name before writing anything
        self.bin_path = str(bin_path)
        self._file = open(self.bin_path, "wb")  # closed by finalize() or close()
        self._lengths = array("i")
        self._doc_index = array("q", [0])

    def add_document(self, tokens: np.ndarray | Sequence[int], lengths: Sequence[int] | None = None) -> None:
        """Append one document: by default one sequence; an empty document is a zero-sequence document.

        ``lengths`` splits the document into several sequences (Megatron's sentence mode); they must sum to
        ``len(tokens)``.
        """
        arr = np.asarray(tokens, dtype=self.dtype)
        if lengths is None:
            lengths = [len(arr)] if len(arr) else []
        if sum(lengths) != len(arr):
            raise ValueError(f"add_document: lengths sum to {sum(lengths)}, document has {len(arr)} tokens")
        self._file.write(arr.tobytes())
        self._lengths.extend(lengths)
        self._doc_index.append(len(self._lengths))

    def add_documents(self, tokens: np.ndarray, doc_lengths: np.ndarray) -> None:
        """Append many one-sequence documents at once: ``tokens`` back to back, ``doc_lengths`` per document
        (0 = an empty, zero-sequence document). Same bytes as calling :meth:`add_document` for each."""
        doc_lengths = np.asarray(doc_lengths, dtype=np.int64)
        if int(doc_lengths.sum()) != len(tokens):
            raise ValueError(f"add_documents: lengths sum to {int(doc_lengths.sum())}, tokens {len(tokens)}")
        if len(doc_lengths) and int(doc_lengths.max()) > np.iinfo(np.int32).max:
            raise ValueError("add_documents: a document exceeds 2^31-1 tokens (int32 sequence lengths)")
        np.asarray(tokens, dtype=self.dtype).tofile(self._file)
        nonempty = doc_lengths > 0
        self._lengths.frombytes(doc_lengths[nonempty].astype("<i4").tobytes())
        ends = self._doc_index[-1] + np.cumsum(nonempty, dtype=np.int64)
        self._doc_index.frombytes(ends.astype("<i8").tobytes())

    def add_index(self, prefix: str | Path) -> None:
        """Append a whole existing dataset (Megatron's ``add_index``): its documents keep their boundaries."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(f"{index_file_path(prefix)}: dtype {other.dtype} differs from the "
                                      f"output's {self.dtype}; datasets to merge must share a tokenizer")
        offset = len(self._lengths)
        self._lengths.frombytes(other.sizes.astype("<i4").tobytes())
        self._doc_index.frombytes((offset + other.document_indices[1:]).astype("<i8").tobytes())
        other.close()
        with open(data_file_path(prefix), "rb") as src:
            shutil.copyfileobj(src, self._file, 16 << 20)

    def finalize(self, idx_path: str | Path) -> None:
        """Flush ``.bin`` and write the index to ``idx_path`` (both fsynced: safe to rename into place)."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32) if self._lengths else np.zeros(0, np.int32)
        doc_index = np.frombuffer(self._doc_index, dtype=np.int64)
        write_index(idx_path, self.dtype, lengths, doc_index)

    def close(self) -> None:
        """Close without writing an index (the caller discards the partial ``.bin``)."""
        self._file.close()


def write_index(idx_path: str | Path, dtype: np.dtype, lengths: np.ndarray, doc_index: np.ndarray) -> None:
    """Write a ``.idx`` for sequences of ``lengths`` grouped by ``doc_index`` (starts at 0, ends at N)."""
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), dtype="<i8")
    np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= itemsize
    with open(idx_path, "wb") as f:
        f.write(MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", dtype_code(dtype)))
        f.write(struct.pack("<QQ", len(lengths), len(doc_index)))
        f.write(np.asarray(lengths, dtype="<i4").tobytes())
        f.write(pointers.tobytes())
        f.write(np.asarray(doc_index, dtype="<i8").tobytes())
        f.flush()
        os.fsync(f.fileno())


class IndexedDataset:
    """Read-only, memory-mapped view of ``{path_prefix}.bin/.idx``, validated at open.

    ``sizes`` (int32, tokens per sequence), ``pointers`` (int64 byte offsets), ``document_indices``
    (int64, M = documents + 1 boundaries), ``dtype``; ``ds[i]`` / ``ds.get(i, offset, length)`` return
    token arrays (views into the memory map: copy them before the dataset is closed).
    """

    def __init__(self, path_prefix: str | Path) -> None:
        self.path_prefix = str(path_prefix)
        self._open()

    def _open(self) -> None:
        idx, binp = index_file_path(self.path_prefix), data_file_path(self.path_prefix)
        self._idx = _map_file(idx, "index")
        self.dtype, n, m = _read_header(idx, self._idx)
        end = HEADER_BYTES
        self.sizes = np.frombuffer(self._idx, dtype="<i4", count=n, offset=end)
        self.pointers = np.frombuffer(self._idx, dtype="<i8", count=n, offset=end + 4 * n)
        self.document_indices = np.frombuffer(self._idx, dtype="<i8", count=m, offset=end + 12 * n)
        _check_index(idx, self.sizes, self.pointers, self.document_indices, self.dtype.itemsize)
        expected = int(self.sizes.sum(dtype=np.int64)) * self.dtype.itemsize
        if not os.path.exists(binp):
            raise IndexedDatasetError(f"{binp}: data file missing (its index {idx} exists)")
        actual = os.path.getsize(binp)
        if actual != expected:
            raise IndexedDatasetError(f"{binp}: {actual} bytes, but {idx} describes {expected} bytes "
                                      f"({expected // self.dtype.itemsize} tokens of {self.dtype}); the pair "
                                      "is truncated or mismatched — regenerate it")
        self._bin = np.memmap(binp, dtype=self.dtype, mode="r") if actual else np.zeros(0, self.dtype)

    def __getstate__(self) -> dict:
        return {"path_prefix": self.path_prefix}  # memory maps do not pickle; reopen on the other side

    def __setstate__(self, state: dict) -> None:
        self.path_prefix = state["path_prefix"]
        self._open()

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, idx: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset+length)`` of sequence ``idx`` (to its end when ``length`` is None)."""
        n = len(self.sizes)
        if not -n <= idx < n:
            raise IndexError(f"sequence {idx} out of range for {self.path_prefix} ({n} sequences)")
        size = int(self.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {idx} "
                             f"of {size} tokens in {self.path_prefix}")
        start = int(self.pointers[idx]) // self.dtype.itemsize + offset
        return self._bin[start:start + length]

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    def documents(self) -> Iterator[np.ndarray]:
        """Each document's tokens (its sequences concatenated), in order."""
        for d in range(self.num_documents):
            lo, hi = int(self.document_indices[d]), int(self.document_indices[d + 1])
            if lo == hi:
                yield np.zeros(0, self.dtype)
            else:
                start = int(self.pointers[lo]) // self.dtype.itemsize
                yield self._bin[start:start + int(self.sizes[lo:hi].sum(dtype=np.int64))]

    def close(self) -> None:
        """Drop the memory maps (arrays handed out before become invalid to use)."""
        self.sizes = self.pointers = self.document_indices = None
        self._bin = None
        if self._idx is not None:
            try:
                self._idx.close()
            except BufferError:  # arrays handed out still point into it; the GC unmaps it after them
                pass
            self._idx = None


def _map_file(path: str, what: str):
    import mmap

    if not os.path.exists(path):
        raise IndexedDatasetError(f"{path}: {what} file missing")
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < HEADER_BYTES:
            raise IndexedDatasetError(f"{path}: {os.fstat(f.fileno()).st_size} bytes, shorter than the "
                                      f"{HEADER_BYTES}-byte header: truncated or not an index file")
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _read_header(path: str, buf) -> tuple[np.dtype, int, int]:
    if bytes(buf[:9]) != MAGIC:
        raise IndexedDatasetError(f"{path}: bad magic {bytes(buf[:9])!r}, expected {MAGIC!r}: not a Megatron "
                                  "MMIDIDX index")
    version, code, n, m = struct.unpack_from("<QBQQ", buf, 9)
    if version != VERSION:
        raise IndexedDatasetError(f"{path}: index version {version}, only version {VERSION} is supported")
    if code not in DTYPE_CODES:
        raise IndexedDatasetError(f"{path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
    expected = HEADER_BYTES + 12 * n + 8 * m
    if m < 1 or len(buf) != expected:
        raise IndexedDatasetError(f"{path}: {len(buf)} bytes, but the header (N={n} sequences, M={m} "
                                  f"document boundaries) needs {expected}: truncated or corrupt")
    return DTYPE_CODES[code], n, m


_BLOCK = 1 << 22  # validate in blocks: bounded temporary memory for indices of any size


def _check_index(path: str, sizes, pointers, doc_index, itemsize: int) -> None:
    n = len(sizes)
    if doc_index[0] != 0 or doc_index[-1] != n:
        raise IndexedDatasetError(f"{path}: document index must rise from 0 to N={n} (got first "
                                  f"{int(doc_index[0])}, last {int(doc_index[-1])}): corrupt")
    for lo in range(0, len(doc_index) - 1, _BLOCK):
        if np.any(np.diff(doc_index[lo:lo + _BLOCK + 1]) < 0):
            raise IndexedDatasetError(f"{path}: document index decreases near document {lo}: corrupt")
    running = 0
    for lo in range(0, n, _BLOCK):
        block = sizes[lo:lo + _BLOCK].astype(np.int64)
        if int(block.min()) < 0:
            raise IndexedDatasetError(f"{path}: negative sequence length at {lo + int(np.argmin(block))}")
        expected = (running + np.cumsum(block) - block) * itemsize
        bad = np.flatnonzero(pointers[lo:lo + _BLOCK] != expected)
        if len(bad):
            i = int(bad[0])
            raise IndexedDatasetError(f"{path}: byte offset of sequence {lo + i} is {int(pointers[lo + i])}, "
                                      f"expected {int(expected[i])}: corrupt")
        running += int(block.sum())


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold SIGINT/SIGTERM until the block ends (main thread only), so renames happen all or none."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    signals = (signal.SIGINT, signal.SIGTERM)
    old = {s: signal.signal(s, lambda sig, _frame: pending.append(sig)) for s in signals}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        for s in pending:
            signal.raise_signal(s)


def publish(pairs: Sequence[tuple[str, str, str]]) -> None:
    """Rename finished ``(tmp_bin, tmp_idx, prefix)`` pairs into place.

    An old ``.idx`` is removed first and the new ``.idx`` renamed last, so at no moment does an index sit
    next to a ``.bin`` it does not describe; interrupts are held for the few renames.
    """
    with deferred_interrupts():
        for tmp_bin, tmp_idx, prefix in pairs:
            Path(index_file_path(prefix)).unlink(missing_ok=True)
            os.replace(tmp_bin, data_file_path(prefix))
            os.replace(tmp_idx, index_file_path(prefix))


def temp_pair(prefix: str | Path) -> tuple[str, str]:
    """Fresh temporary ``.bin``/``.idx`` names next to ``prefix`` (same filesystem: renames are atomic)."""
    folder, name = os.path.split(os.path.abspath(prefix))
    os.makedirs(folder, exist_ok=True)
    fd, tmp_bin = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".bin.partial")
    os.close(fd)
    as_open_would(tmp_bin)
    return tmp_bin, tmp_bin[: -len(".bin.partial")] + ".idx.partial"


def merge_datasets(prefixes: Sequence[str | Path], out_prefix: str | Path) -> str:
    """Concatenate datasets (same dtype) into ``out_prefix`` exactly as Megatron's merge tool does."""
    if not prefixes:
        raise ValueError("merge_datasets: no input prefixes")
    first = IndexedDataset(prefixes[0])
    dtype = first.dtype
    first.close()
    tmp_bin, tmp_idx = temp_pair(out_prefix)
    builder = IndexedDatasetBuilder(tmp_bin, dtype)
    try:
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(tmp_idx)
        publish([(tmp_bin, tmp_idx, str(out_prefix))])
    except BaseException:
        builder.close()
        for p in (tmp_bin, tmp_idx):
            Path(p).unlink(missing_ok=True)
        raise
    return str(out_prefix)
