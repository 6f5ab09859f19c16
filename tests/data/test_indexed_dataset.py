"""Megatron .bin/.idx: golden bytes (formats.md), round trips, merge, and clear errors for every kind of
damage. Megatron-core's own IndexedDataset and IndexedDatasetBuilder are the oracle in
tests/mcore/test_data.py."""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest

from trainer.data.indexed_dataset import (
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    best_fitting_dtype,
    merge_datasets,
)

# formats.md §1 worked example: two documents of 3 and 5 tokens, uint16.
GOLDEN_82 = bytes.fromhex(
    "4d4d49444944580000" "0100000000000000" "08" "0200000000000000" "0300000000000000" "03000000" "05000000"
    "0000000000000000" "0600000000000000" "0000000000000000" "0100000000000000" "0200000000000000")


def write(prefix, docs, dtype=np.uint16) -> None:
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for doc in docs:
        builder.add_document(np.asarray(doc))
    builder.finalize(f"{prefix}.idx")


def test_golden_82_byte_index(tmp_path):
    write(tmp_path / "g", [[1, 2, 3], [4, 5, 6, 7, 8]])
    assert (tmp_path / "g.idx").read_bytes() == GOLDEN_82
    assert (tmp_path / "g.bin").read_bytes() == np.arange(1, 9, dtype="<u2").tobytes()
    ds = IndexedDataset(tmp_path / "g")
    assert len(ds) == 2 and ds.dtype == np.uint16 and ds.num_documents == 2
    assert ds.sizes.dtype == np.int32 and ds.document_indices.dtype == np.int64
    assert ds.sizes.tolist() == [3, 5] and ds.document_indices.tolist() == [0, 1, 2]
    assert ds[0].tolist() == [1, 2, 3] and ds[-1].tolist() == [4, 5, 6, 7, 8]
    assert ds.get(1, offset=1, length=3).tolist() == [5, 6, 7] and ds.get(1, offset=3).tolist() == [7, 8]
    assert [a.tolist() for a in ds[0:2]] == [[1, 2, 3], [4, 5, 6, 7, 8]]
    with pytest.raises(IndexError, match="out of range"):
        ds.get(2)
    with pytest.raises(IndexError, match="out of range"):
        ds.get(0, offset=2, length=5)


def test_round_trip_real_data_and_empty_documents(tmp_path):
    # Real data: the bytes of this interpreter's stdlib sources as "tokens", one document per file,
    # with empty documents sprinkled in (kept as zero-sequence documents, as current Megatron does).
    import sysconfig
    from pathlib import Path

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:60]
    docs = [np.frombuffer(f.read_bytes(), dtype=np.uint8).astype(np.uint16) for f in files]
    docs[3] = docs[17] = np.zeros(0, np.uint16)
    docs.append(np.zeros(0, np.uint16))
    write(tmp_path / "a", docs)
    # add_documents (the batched path preprocess uses) must give the same bytes as add_document.
    builder = IndexedDatasetBuilder(tmp_path / "b.bin", np.uint16)
    builder.add_documents(np.concatenate(docs[:30]), np.array([len(d) for d in docs[:30]]))
    builder.add_documents(np.concatenate(docs[30:]), np.array([len(d) for d in docs[30:]]))
    builder.finalize(tmp_path / "b.idx")
    for ext in ("bin", "idx"):
        assert (tmp_path / f"a.{ext}").read_bytes() == (tmp_path / f"b.{ext}").read_bytes()
    # Megatron's own reader and writer agree with these bytes: tests/mcore/test_data.py.
    ds = IndexedDataset(tmp_path / "a")
    assert ds.num_documents == len(docs) and len(ds) == len(docs) - 3
    for got, want in zip(ds.documents(), docs, strict=True):
        assert np.array_equal(got, want)


def test_dtype_rule_and_int32(tmp_path):
    assert best_fitting_dtype(32768) == np.uint16 and best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.int32 and best_fitting_dtype(50257) == np.uint16
    write(tmp_path / "w", [[70000, 1], [2**31 - 1]], dtype=np.int32)
    ds = IndexedDataset(tmp_path / "w")
    assert ds.dtype == np.int32 and ds[0].tolist() == [70000, 1] and ds[1].tolist() == [2**31 - 1]


def test_multi_sequence_documents_and_pickle(tmp_path):
    builder = IndexedDatasetBuilder(tmp_path / "s.bin", np.uint16)
    builder.add_document([1, 2, 3, 4, 5], lengths=[2, 3])
    builder.add_document([])
    builder.add_document([9])
    builder.finalize(tmp_path / "s.idx")
    ds = IndexedDataset(tmp_path / "s")
    assert ds.document_indices.tolist() == [0, 2, 2, 3] and ds.sizes.tolist() == [2, 3, 1]
    clone = pickle.loads(pickle.dumps(ds))
    assert [a.tolist() for a in clone.documents()] == [[1, 2, 3, 4, 5], [], [9]]
    with pytest.raises(ValueError, match="lengths sum to 4"):
        builder2 = IndexedDatasetBuilder(tmp_path / "x.bin", np.uint16)
        builder2.add_document([1, 2, 3], lengths=[4])


def test_merge_equals_single_build(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 30000, size=int(n)) for n in rng.integers(0, 50, size=40)]
    write(tmp_path / "all", docs)
    write(tmp_path / "p1", docs[:15])
    write(tmp_path / "p2", docs[15:])
    merge_datasets([tmp_path / "p1", tmp_path / "p2"], tmp_path / "merged")
    for ext in ("bin", "idx"):
        assert (tmp_path / f"merged.{ext}").read_bytes() == (tmp_path / f"all.{ext}").read_bytes()
    write(tmp_path / "wide", [[1]], dtype=np.int32)
    with pytest.raises(IndexedDatasetError, match="dtype int32 differs"):
        merge_datasets([tmp_path / "p1", tmp_path / "wide"], tmp_path / "bad")
    assert not list(tmp_path.glob("bad*")) and not list(tmp_path.glob(".bad*"))


def _damage(tmp_path, what):
    write(tmp_path / "d", [[1, 2, 3], [4, 5, 6, 7, 8]])
    idx, binp = tmp_path / "d.idx", tmp_path / "d.bin"
    raw = bytearray(idx.read_bytes())
    if what == "idx_truncated":
        idx.write_bytes(raw[:-8])
    elif what == "idx_header_only":
        idx.write_bytes(raw[:20])
    elif what == "magic":
        idx.write_bytes(b"XXIDIDX\x00\x00" + raw[9:])
    elif what == "version":
        idx.write_bytes(raw[:9] + struct.pack("<Q", 2) + raw[17:])
    elif what == "dtype":
        idx.write_bytes(raw[:17] + b"\x09" + raw[18:])
    elif what == "bin_truncated":
        binp.write_bytes(binp.read_bytes()[:-2])
    elif what == "bin_extra":
        binp.write_bytes(binp.read_bytes() + b"\x00\x00")
    elif what == "bin_missing":
        binp.unlink()
    elif what == "idx_missing":
        idx.unlink()
    elif what == "pointer":
        raw[34 + 8 + 8:34 + 8 + 16] = struct.pack("<q", 4)
        idx.write_bytes(raw)
    elif what == "doc_index":
        raw[-8:] = struct.pack("<q", 1)
        idx.write_bytes(raw)
    return tmp_path / "d"


@pytest.mark.parametrize("what, file, message", [
    ("idx_truncated", "d.idx", "truncated or corrupt"),
    ("idx_header_only", "d.idx", "shorter than the 34-byte header"),
    ("magic", "d.idx", "bad magic"),
    ("version", "d.idx", "index version 2"),
    ("dtype", "d.idx", "unknown dtype code 9"),
    ("bin_truncated", "d.bin", "14 bytes, but .* describes 16 bytes"),
    ("bin_extra", "d.bin", "18 bytes, but .* describes 16 bytes"),
    ("bin_missing", "d.bin", "data file missing"),
    ("idx_missing", "d.idx", "index file missing"),
    ("pointer", "d.idx", "byte offset of sequence 1 is 4, expected 6"),
    ("doc_index", "d.idx", "document index must rise from 0 to N=2"),
])
def test_damaged_pairs_fail_clearly(tmp_path, what, file, message):
    prefix = _damage(tmp_path, what)
    with pytest.raises(IndexedDatasetError, match=message) as err:
        IndexedDataset(prefix)
    assert str(tmp_path / file) in str(err.value)
