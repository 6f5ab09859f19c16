"""The index cache trusts an entry only when its files match the digests its completion record holds
(trainer/data/index_cache.py): an overwritten or truncated array is rebuilt by the builder rank, with one
line naming the file and what was wrong, and every other rank waits for the rebuilt entry instead of
reading the damaged one (a shared ``runs_root/_cache`` must not poison a second run)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.data.test_gpt_dataset import ArraySource, build, random_docs
from tests.logs import captured
from tests.waits import NEVER_S, wait_until
from trainer.data.index_cache import (
    DamagedEntry,
    IndexCacheConfig,
    cache_description,
    cache_paths,
    read_entry,
    write_entry,
)
from trainer.data.index_helpers import IndexSpec

SPEC = IndexSpec(16, 30)


def _entry(cache: Path, source: ArraySource) -> dict[str, str]:
    return cache_paths(str(cache), cache_description(source.sizes, (0, 58), SPEC, "train"))


def _samples(ds) -> list[list[int]]:
    return [ds[i].tolist() for i in range(len(ds))]


def _overwrite_with_zeros(path: str) -> None:
    """The same array file, same size and header, every value zero: a shape check cannot see it."""
    a = np.load(path)
    np.save(path, np.zeros_like(a))


def test_an_overwritten_entry_is_rebuilt_by_the_builder_with_a_line_naming_the_file(tmp_path):
    source = ArraySource(random_docs(4))
    good = _samples(build(source, tmp_path, 16, {"train": 30})["train"])
    shuffle = next(str(p) for p in (tmp_path / "cache").iterdir() if p.name.endswith("shuffle_index.npy"))
    size = os.path.getsize(shuffle)
    _overwrite_with_zeros(shuffle)
    assert os.path.getsize(shuffle) == size
    with captured() as lines:
        rebuilt = _samples(build(source, tmp_path, 16, {"train": 30})["train"])
    assert rebuilt == good  # not one sample over and over
    damaged = [ln for ln in lines if "rebuilding the entry" in ln]
    assert len(damaged) == 1 and f"{shuffle} differs from the SHA-256 recorded" in damaged[0], lines
    with captured() as lines:  # and now a plain hit
        assert _samples(build(source, tmp_path, 16, {"train": 30})["train"]) == good
    assert not [ln for ln in lines if "rebuilding" in ln]


def test_a_reader_waits_for_the_builder_to_rebuild_a_truncated_entry(tmp_path):
    """The reader comes first and finds the truncated file: it waits (saying why) instead of dying on
    numpy's 'mmap length is greater than file size', and reads the builder's rebuilt entry."""
    source = ArraySource(random_docs(5))
    good = _samples(build(source, tmp_path, 16, {"train": 30})["train"])
    sample = _entry(tmp_path / "cache", source)["sample_index"]
    with open(sample, "r+b") as f:
        f.truncate(os.path.getsize(sample) // 2)
    got: dict = {}

    def reader() -> None:
        got["samples"] = _samples(build(source, tmp_path, 16, {"train": 30}, is_builder=False,
                                        wait_timeout_s=NEVER_S)["train"])

    with captured() as lines:
        thread = threading.Thread(target=reader)
        thread.start()
        wait_until(lambda: any("waiting for the builder rank" in ln for ln in lines), "the reader to wait")
        assert thread.is_alive() and not got
        build(source, tmp_path, 16, {"train": 30})  # the builder rank, now
        thread.join(NEVER_S)
    assert got["samples"] == good
    said = next(ln for ln in lines if "waiting for the builder rank" in ln)
    assert f"{sample} is " in said and "(truncated or replaced)" in said


@pytest.mark.parametrize("damage", ["zeros", "truncate", "no record"])
def test_a_reader_without_a_builder_times_out_naming_the_entry_and_the_damage(tmp_path, damage):
    source = ArraySource(random_docs(6))
    build(source, tmp_path, 16, {"train": 30})
    paths = _entry(tmp_path / "cache", source)
    if damage == "zeros":
        _overwrite_with_zeros(paths["shuffle_index"])
        why = f"{paths['shuffle_index']} differs from the SHA-256"
    elif damage == "truncate":
        os.truncate(paths["document_index"], 10)
        why = f"{paths['document_index']} is 10 bytes, its entry recorded"
    else:
        os.unlink(paths["description"])
        why = "it was never written"
    with pytest.raises(TimeoutError) as err:
        build(source, tmp_path, 16, {"train": 30}, is_builder=False, wait_timeout_s=0.3)
    assert f"for the index cache entry {paths['description']}, which the builder rank writes: {why}" in \
        str(err.value)


def test_an_entry_written_before_digests_is_rebuilt(tmp_path):
    source = ArraySource(random_docs(7))
    good = _samples(build(source, tmp_path, 16, {"train": 30})["train"])
    marker = _entry(tmp_path / "cache", source)["description"]
    record = json.loads(Path(marker).read_text())
    del record["files"]  # what an older Slipway wrote
    Path(marker).write_text(json.dumps(record))
    with captured() as lines:
        assert _samples(build(source, tmp_path, 16, {"train": 30})["train"]) == good
    assert any(f"{marker} records no digest of its files" in ln for ln in lines), lines
    assert "files" in json.loads(Path(marker).read_text())


def test_read_entry_checks_each_file_against_the_record(tmp_path):
    files = {"a": str(tmp_path / "a.npy"), "b": str(tmp_path / "b.npy")}
    marker = str(tmp_path / "entry.json")
    write_entry(marker, files, {"a": np.arange(5), "b": np.ones((2, 3), np.int32)}, {"key": {"k": 1}})
    record, arrays = read_entry(marker, files, {"k": 1})
    assert record["files"]["a"]["bytes"] == os.path.getsize(files["a"]) and arrays["b"].shape == (2, 3)
    with pytest.raises(DamagedEntry, match="describes another entry"):
        read_entry(marker, files, {"k": 2})
    np.save(files["b"], np.ones((3, 2), np.int32))  # same bytes, another shape: the digest differs too
    with pytest.raises(DamagedEntry, match=r"b.npy differs from the SHA-256"):
        read_entry(marker, files, {"k": 1})
    os.unlink(files["a"])
    with pytest.raises(DamagedEntry, match=r"a.npy is missing"):
        read_entry(marker, files, {"k": 1})


def test_a_damaged_blend_entry_is_rebuilt_too(tmp_path):
    from trainer.data.blended_dataset import _load_or_build_indices

    cache = IndexCacheConfig(str(tmp_path), is_builder=True)
    first = [a.copy() for a in _load_or_build_indices([0.3, 0.7], 50, "train", cache)]
    target = next(str(p) for p in tmp_path.iterdir() if p.name.endswith("dataset_index.npy"))
    _overwrite_with_zeros(target)
    with captured() as lines:
        again = _load_or_build_indices([0.3, 0.7], 50, "train", cache)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert any(f"{target} differs from the SHA-256" in ln for ln in lines), lines
