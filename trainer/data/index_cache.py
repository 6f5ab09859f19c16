"""On-disk cache of the GPT index arrays: built once by the builder rank, memory-mapped by every rank.

The key hashes everything that changes the arrays (Megatron-2022 keyed on samples/seq-len/seed only and
silently reused stale maps after a split change):

- the data: a SHA-256 of the split's sequence lengths plus the total sequence count (the indices depend on
  the data only through these, so a copied or moved dataset reuses its cache, and any edit that changes a
  length rebuilds);
- the split name and document range; samples, sequence length, seed, extra-token and drop-last flags;
- ``ALGORITHM_VERSION``, bumped whenever the index code changes its output.

Files are ``<cache_dir>/<key>-<split>-{document,sample,shuffle}_index.npy`` plus ``...-description.json``.
Each is written to a temporary name, fsynced and renamed into place; the description is renamed last and
is the commit marker, so a reader that sees it sees complete arrays, and never a partial file.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np

from trainer.data.index_helpers import GPTIndices, IndexSpec, build_gpt_indices
from trainer.disk import as_open_would
from trainer.log import get_logger

log = get_logger(__name__)

ALGORITHM_VERSION = "slipway-gpt-indices-1"
_ARRAYS = ("document_index", "sample_index", "shuffle_index")


@dataclass(frozen=True)
class IndexCacheConfig:
    """Where the cache lives and this caller's role.

    cache_dir: folder for the ``.npy`` files; must be shared by every rank that passes is_builder=False
        and waits on this builder (a node-local folder needs one builder per node: local rank 0).
    is_builder: True on exactly one rank per cache_dir; it builds on a miss and writes the files.
    wait_timeout_s: how long a non-builder waits for the builder's files before failing.
    poll_interval_s: how often a non-builder looks for them.
    """

    cache_dir: str
    is_builder: bool
    wait_timeout_s: float = 900.0
    poll_interval_s: float = 0.2

    def __post_init__(self) -> None:
        if not self.cache_dir:
            raise ValueError("IndexCacheConfig.cache_dir is empty; set data.cache_dir")
        if self.wait_timeout_s <= 0 or self.poll_interval_s <= 0:
            raise ValueError("IndexCacheConfig.wait_timeout_s and poll_interval_s must be > 0, got "
                             f"{self.wait_timeout_s} and {self.poll_interval_s}")


def sizes_fingerprint(sizes: np.ndarray, doc_range: tuple[int, int]) -> str:
    """SHA-256 of the little-endian int32 sequence lengths of ``[begin, end)``."""
    begin, end = doc_range
    block = np.ascontiguousarray(sizes[begin:end], dtype="<i4")
    return hashlib.sha256(memoryview(block).cast("B")).hexdigest()


def cache_description(sizes: np.ndarray, doc_range: tuple[int, int], spec: IndexSpec, split: str) -> dict:
    """Everything the arrays depend on, as a JSON-able dict (hashed into the file names)."""
    return {
        "algorithm": ALGORITHM_VERSION,
        "split": split,
        "doc_range": [int(doc_range[0]), int(doc_range[1])],
        "num_sequences": int(len(sizes)),
        "sizes_sha256": sizes_fingerprint(sizes, doc_range),
        "spec": asdict(spec),
    }


def cache_key(description: dict) -> str:
    text = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def cache_paths(cache_dir: str, description: dict) -> dict[str, str]:
    base = os.path.join(cache_dir, f"{cache_key(description)}-{description['split']}")
    paths = {name: f"{base}-{name}.npy" for name in _ARRAYS}
    paths["description"] = f"{base}-description.json"
    return paths


def _atomic_write(path: str, write) -> None:
    """Write via ``write(fileobj)`` to a temporary file in the same folder, fsync, rename into place."""
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-" + os.path.basename(path) + ".", dir=folder)
    try:
        as_open_would(tmp)  # a cache the group shares: readable as any file this user writes
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _describe_arrays(indices: GPTIndices) -> dict:
    arrays = {name: {"shape": list(getattr(indices, name).shape), "dtype": str(getattr(indices, name).dtype)}
              for name in _ARRAYS}
    return {"arrays": arrays, "num_epochs": indices.num_epochs,
            "separate_last_epoch": bool(indices.separate_last_epoch)}


def write_cache(paths: dict[str, str], description: dict, indices: GPTIndices) -> None:
    """Write the three arrays, then the description (the commit marker), each atomically."""
    os.makedirs(os.path.dirname(paths["description"]), exist_ok=True)
    for name in _ARRAYS:
        array = getattr(indices, name)
        _atomic_write(paths[name], lambda f, a=array: np.save(f, a, allow_pickle=False))
    record = {"key": description, **_describe_arrays(indices)}
    _atomic_write(paths["description"], lambda f: f.write(json.dumps(record, indent=2).encode()))


def read_cache(paths: dict[str, str], description: dict) -> GPTIndices:
    """Memory-map the cached arrays; raise ValueError when they do not match ``description``."""
    with open(paths["description"], encoding="utf-8") as f:
        record = json.load(f)
    if record.get("key") != description:
        raise ValueError(f"{paths['description']} describes other indices than requested (hash collision or "
                         "a foreign file); delete it")
    arrays = {name: np.load(paths[name], mmap_mode="r", allow_pickle=False) for name in _ARRAYS}
    indices = GPTIndices(arrays["document_index"], arrays["sample_index"], arrays["shuffle_index"],
                         int(record["num_epochs"]), bool(record["separate_last_epoch"]))
    if _describe_arrays(indices) != {k: record[k] for k in ("arrays", "num_epochs", "separate_last_epoch")}:
        raise ValueError(f"cached arrays next to {paths['description']} do not match their description "
                         "(truncated or replaced files); delete them to rebuild")
    return indices


def _wait_for(path: str, cache: IndexCacheConfig) -> None:
    deadline = time.monotonic() + cache.wait_timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"waited {cache.wait_timeout_s:.0f} s for the index cache {path}, which the builder rank "
                "writes. Check the builder's log for an error; if cache_dir is node-local, make local rank 0 "
                "of every node a builder, or point data.cache_dir at a folder all nodes share.")
        time.sleep(cache.poll_interval_s)


def load_or_build(sizes: np.ndarray, doc_range: tuple[int, int], spec: IndexSpec, split: str,
                  cache: IndexCacheConfig, impl: str = "auto") -> GPTIndices:
    """The indices of one split: memory-mapped from the cache, built and written first by the builder."""
    description = cache_description(sizes, doc_range, spec, split)
    paths = cache_paths(cache.cache_dir, description)
    if not cache.is_builder:
        _wait_for(paths["description"], cache)
        return read_cache(paths, description)
    if os.path.exists(paths["description"]):
        try:
            indices = read_cache(paths, description)
            log.info("%s indices: cache hit %s", split, paths["description"])
            return indices
        except (ValueError, OSError) as exc:
            log.warning("%s indices: unusable cache (%s); rebuilding", split, exc)
            os.unlink(paths["description"])  # readers must not trust the old arrays while we rewrite them
    begin, end = doc_range
    t0 = time.perf_counter()
    indices = build_gpt_indices(sizes, np.arange(begin, end, dtype=np.int32), spec, impl=impl)
    write_cache(paths, description, indices)
    log.info("%s indices: built in %.2f s, cached under %s", split, time.perf_counter() - t0, cache.cache_dir)
    return read_cache(paths, description)
