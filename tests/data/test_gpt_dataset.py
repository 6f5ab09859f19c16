"""GPTDataset: split rounding, samples read across document boundaries, index cache keys and sharing."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from tests.waits import NEVER_S
from trainer.data import index_cache
from trainer.data.gpt_dataset import (
    GPTDatasetConfig,
    build_gpt_datasets,
    megatron_num_samples,
    parse_split,
    split_ranges,
)
from trainer.data.index_cache import (
    IndexCacheConfig,
    _atomic_write,
    cache_description,
    cache_key,
    load_or_build,
)
from trainer.data.index_helpers import IndexSpec


class ArraySource:
    """Documents held in memory with the IndexedDataset reading interface (sizes, get)."""

    def __init__(self, docs: list[np.ndarray]) -> None:
        self.docs = docs
        self.sizes = np.array([len(d) for d in docs], dtype=np.int32)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        doc = self.docs[idx]
        end = len(doc) if length is None else offset + length
        assert 0 <= offset <= end <= len(doc), (idx, offset, length, len(doc))
        return doc[offset:end]


def random_docs(seed: int, num_docs: int = 60, max_len: int = 90) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_len, num_docs)
    lengths[rng.random(num_docs) < 0.15] = 0  # empty documents
    return [rng.integers(0, 50_000, n).astype(np.uint16) for n in lengths]


# --- split ---------------------------------------------------------------------------------------------

def test_split_969_30_1():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert split_ranges("969,30,1", 1000) == {"train": (0, 969), "valid": (969, 999), "test": (999, 1000)}


def test_split_rounds_cumulative_bounds():
    # Cumulative bookends 1/3, 2/3 of 10 docs: round(3.33) = 3, round(6.67) = 7 (not 3 + 3).
    assert split_ranges("1,1,1", 10) == {"train": (0, 3), "valid": (3, 7), "test": (7, 10)}
    # Python's round: 2.5 -> 2 (Megatron uses the same builtin).
    assert split_ranges("1,1", 5) == {"train": (0, 2), "valid": (2, 5), "test": None}
    assert split_ranges("100,0,0", 7) == {"train": (0, 7), "valid": None, "test": None}
    assert split_ranges(" 98 / 2 ", 100)["valid"] == (98, 100)


def test_split_ranges_tile_every_document():
    rng = np.random.default_rng(0)
    for _ in range(300):
        weights = rng.integers(0, 1000, 3)
        if weights.sum() == 0:
            continue
        n = int(rng.integers(0, 5000))
        ranges = split_ranges(",".join(map(str, weights)), n)
        bounds = [r for r in ranges.values() if r is not None]
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))


@pytest.mark.parametrize("bad", ["", "a,b", "1,2,3,4", "-1,2", "0,0,0", "1,,2"])
def test_split_rejects_bad_strings(bad):
    with pytest.raises(ValueError, match="data.split"):
        parse_split(bad)


def test_megatron_num_samples():
    assert megatron_num_samples(100, 8, 10, 2) == {"train": 800, "valid": (100 // 10 + 1) * 2 * 8,
                                                   "test": 16}


# --- samples -------------------------------------------------------------------------------------------

def build(source, tmp_path, seq, samples, is_builder=True, **cfg):
    config = GPTDatasetConfig(seq_length=seq, cache_dir=str(tmp_path / "cache"), **cfg)
    return build_gpt_datasets(source, str(tmp_path / "data"), samples, config, is_builder=is_builder)


@pytest.mark.parametrize("seq,train_samples", [(16, 40), (7, 300), (64, 90)])
def test_samples_are_the_shuffled_stream_across_document_boundaries(tmp_path, seq, train_samples):
    source = ArraySource(random_docs(seq))
    sets = build(source, tmp_path, seq, {"train": train_samples, "valid": 5}, split="80,20,0")
    assert sets["test"] is None
    for ds in (sets["train"], sets["valid"]):
        stream = np.concatenate([source.docs[d] for d in ds.document_index]).astype(np.int64)
        begin, end = ds.doc_range
        assert set(np.unique(ds.document_index)) <= set(range(begin, end))
        crossing = 0
        for i in range(len(ds)):
            sample = ds[i]
            sid = int(ds.shuffle_index[i])
            assert sample.dtype == np.int64 and sample.shape == (seq + 1,)
            np.testing.assert_array_equal(sample, stream[sid * seq: sid * seq + seq + 1])
            crossing += len(ds.document_ids(i)) > 1
        assert crossing > 0
    assert len(sets["train"]) >= train_samples
    assert sorted(int(s) for s in sets["train"].shuffle_index) == list(range(len(sets["train"])))
    with pytest.raises(IndexError):
        sets["train"][len(sets["train"])]


def test_split_without_documents_but_with_samples_is_an_error(tmp_path):
    source = ArraySource(random_docs(1, num_docs=10))
    with pytest.raises(ValueError, match="gives it no documents"):
        build(source, tmp_path, 8, {"train": 4, "test": 2}, split="100,0,0")


# --- cache ---------------------------------------------------------------------------------------------

def description(sizes, doc_range=(0, 50), seq=16, samples=100, seed=1234, split="train"):
    return cache_description(sizes, doc_range, IndexSpec(seq, samples, seed), split)


def test_cache_key_changes_with_everything_that_changes_the_indices():
    sizes = ArraySource(random_docs(2)).sizes
    base = cache_key(description(sizes))
    assert cache_key(description(sizes.copy())) == base  # same content: same key (a copied dataset reuses)
    changed = sizes.copy()
    changed[10] += 1
    variants = [
        description(changed), description(sizes, doc_range=(0, 49)), description(sizes, seq=17),
        description(sizes, samples=101), description(sizes, seed=1), description(sizes, split="valid"),
        description(np.concatenate([sizes, [3]]).astype(np.int32)),  # one more document beyond the range
    ]
    keys = {cache_key(d) for d in variants}
    assert base not in keys and len(keys) == len(variants)
    outside = sizes.copy()
    outside[55] += 1  # outside the split's range: its indices cannot change
    assert cache_key(description(outside)) == base


def test_cache_is_reused_and_rebuilt_when_inputs_change(tmp_path):
    source = ArraySource(random_docs(3))
    first = build(source, tmp_path, 16, {"train": 50})["train"]
    files = sorted(os.listdir(tmp_path / "cache"))
    assert len(files) == 4 and not any(f.startswith(".tmp") for f in files)
    stamps = {f: os.stat(tmp_path / "cache" / f).st_mtime_ns for f in files}
    again = build(source, tmp_path, 16, {"train": 50})["train"]
    assert {f: os.stat(tmp_path / "cache" / f).st_mtime_ns for f in files} == stamps  # not rewritten
    assert isinstance(again.sample_index, np.memmap)
    np.testing.assert_array_equal(first.shuffle_index, again.shuffle_index)
    build(source, tmp_path, 16, {"train": 50}, seed=99)
    build(source, tmp_path, 16, {"train": 50}, split="90,10,0")
    build(source, tmp_path, 8, {"train": 50})
    assert len(os.listdir(tmp_path / "cache")) == 4 * 4


def test_atomic_write_leaves_nothing_when_interrupted(tmp_path):
    def explode(f):
        f.write(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _atomic_write(str(tmp_path / "x.npy"), explode)
    assert os.listdir(tmp_path) == []


def test_reader_waits_for_the_builder_then_memory_maps(tmp_path, monkeypatch):
    sizes = ArraySource(random_docs(5)).sizes
    spec = IndexSpec(16, 40)
    reader_cfg = IndexCacheConfig(str(tmp_path), is_builder=False, wait_timeout_s=NEVER_S,
                                  poll_interval_s=0.02)
    got, polls = {}, threading.Semaphore(0)
    real_sleep = index_cache.time.sleep

    def counted_sleep(seconds: float) -> None:  # the reader's poll: it found nothing and waits
        polls.release()
        real_sleep(seconds)

    monkeypatch.setattr(index_cache, "time", SimpleNamespace(**{**vars(time), "sleep": counted_sleep}))
    reader = threading.Thread(target=lambda: got.update(r=load_or_build(sizes, (0, 60), spec, "train",
                                                                         reader_cfg)))
    reader.start()
    for _ in range(2):  # it has looked twice and is still waiting: nothing built yet
        assert polls.acquire(timeout=NEVER_S)
    assert reader.is_alive() and not got
    built = load_or_build(sizes, (0, 60), spec, "train", IndexCacheConfig(str(tmp_path), is_builder=True))
    reader.join(NEVER_S)
    np.testing.assert_array_equal(got["r"].sample_index, built.sample_index)
    assert isinstance(got["r"].document_index, np.memmap)


def test_reader_times_out_with_a_clear_message(tmp_path):
    sizes = ArraySource(random_docs(6)).sizes
    cfg = IndexCacheConfig(str(tmp_path), is_builder=False, wait_timeout_s=0.2, poll_interval_s=0.05)
    with pytest.raises(TimeoutError, match="builder rank"):
        load_or_build(sizes, (0, 60), IndexSpec(8, 10), "train", cfg)


def _rank_main(rank: int, cache_dir: str, out: str) -> None:
    source = ArraySource(random_docs(7))
    config = GPTDatasetConfig(seq_length=12, cache_dir=cache_dir, wait_timeout_s=NEVER_S)
    ds = build_gpt_datasets(source, "unused", {"train": 64}, config, is_builder=rank == 0)["train"]
    np.save(out, np.stack([ds[i] for i in range(len(ds))]))


def test_rank0_builds_and_other_processes_read_the_same_samples(tmp_path):
    ctx = multiprocessing.get_context("fork")
    outs = [str(tmp_path / f"rank{r}.npy") for r in range(3)]
    # Readers start first (in any order the scheduler likes): they must wait for rank 0 rather than build
    # or read partial files.
    procs = [ctx.Process(target=_rank_main, args=(r, str(tmp_path / "cache"), outs[r])) for r in (1, 2, 0)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(NEVER_S)
        assert p.exitcode == 0
    samples = [np.load(o) for o in outs]
    assert all(np.array_equal(samples[0], s) for s in samples[1:])
    assert len(os.listdir(tmp_path / "cache")) == 4


def test_cache_files_are_readable_by_the_group_that_shares_the_cache(tmp_path):
    """Files get the mode any file this user writes gets (0666 less the umask), not mkstemp's 0600."""
    old = os.umask(0o002)  # a group-shared project folder's usual umask
    try:
        build(ArraySource(random_docs(3)), tmp_path, 16, {"train": 50})
    finally:
        os.umask(old)
    modes = {f: os.stat(tmp_path / "cache" / f).st_mode & 0o777 for f in os.listdir(tmp_path / "cache")}
    assert len(modes) == 4 and set(modes.values()) == {0o664}, {f: oct(m) for f, m in modes.items()}
