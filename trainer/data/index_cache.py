"""On-disk cache of the GPT index arrays: built once by the builder rank, memory-mapped by every rank.

The key hashes everything that changes the arrays (Megatron-2022 keyed on samples/seq-len/seed only and
silently reused stale maps after a split change):

- the data: a SHA-256 of the split's sequence lengths plus the total sequence count (the indices depend on
  the data only through these, so a copied or moved dataset reuses its cache, and any edit that changes a
  length rebuilds);
- the split name and document range; samples, sequence length, seed, extra-token and drop-last flags;
- ``ALGORITHM_VERSION``, bumped whenever the index code changes its output.

An entry is ``<cache_dir>/<key>-<split>-{document,sample,shuffle}_index.npy`` plus ``...-description.json``,
the completion record. Each array is written to a temporary name, fsynced and renamed into place; the
record is written last (atomically, the same way) and holds every array's size and SHA-256. An entry is
used only when its record is there and every file matches it, so a reader never trusts a partial, truncated
or overwritten file (``runs_root/_cache`` is shared by every run: one damaged entry would poison them all):

- the builder rank rebuilds a damaged entry, saying in one line which file and what was wrong with it;
- every other rank waits for a complete entry that matches its record (the builder's, or the rebuilt one),
  for at most ``wait_timeout_s``, then fails naming the entry and what it last found wrong.

The digest is the price of that trust: every rank reads each array once more (SHA-256, the hash the
checkpoint manifests use; the data loader pages the arrays in anyway). Measured with
``python bench/index_build.py`` on the shared 2-core machine (load average ~11): 3 ms for the 3.6 MB entry
of 300 M tokens at S=2048, 45 ms for 17.8 MB (1 B tokens, S=1024), 0.24 s for 160 MB (3 B tokens, 2.5
epochs, S=1024) — per rank, once per start (bench/results/index_build_digest.txt).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from trainer.data.index_helpers import GPTIndices, IndexSpec, build_gpt_indices
from trainer.disk import as_open_would, sha256_file
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
    wait_timeout_s: how long a non-builder waits for the builder's complete entry before failing.
    poll_interval_s: how often a non-builder looks for it.
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


class DamagedEntry(ValueError):
    """A cache entry whose files do not match its completion record (the message names the file)."""


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


# ------------------------------------------------------------------------- entries: write, check, wait

def write_entry(marker: str, files: dict[str, str], arrays: dict[str, np.ndarray], record: dict) -> None:
    """Each array into ``files[name]`` atomically, then ``record`` plus every file's size and SHA-256 into
    ``marker``, the completion record, last (atomically): a reader that sees it sees complete files."""
    os.makedirs(os.path.dirname(marker), exist_ok=True)
    stored = {}
    for name, array in arrays.items():
        _atomic_write(files[name], lambda f, a=array: np.save(f, a, allow_pickle=False))
        stored[name] = {"bytes": os.path.getsize(files[name]), "sha256": sha256_file(files[name])}
    shapes = {name: {"shape": list(a.shape), "dtype": str(a.dtype)} for name, a in arrays.items()}
    record = {**record, "arrays": shapes, "files": stored}
    _atomic_write(marker, lambda f: f.write(json.dumps(record, indent=2).encode()))


def _check_file(path: str, expected: dict) -> None:
    """Raise DamagedEntry naming ``path`` when its size or SHA-256 is not the recorded one."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise DamagedEntry(f"{path} is missing") from None
    if size != expected["bytes"]:
        raise DamagedEntry(f"{path} is {size} bytes, its entry recorded {expected['bytes']} (truncated or "
                           "replaced)")
    if sha256_file(path) != expected["sha256"]:
        raise DamagedEntry(f"{path} differs from the SHA-256 recorded when it was built (overwritten)")


def read_entry(marker: str, files: dict[str, str], key: dict) -> tuple[dict, dict[str, np.ndarray]]:
    """(record, memory-mapped arrays) of a complete entry whose record holds ``key``; FileNotFoundError
    when there is no record yet, DamagedEntry (naming the file and what is wrong) when it does not hold."""
    with open(marker, encoding="utf-8") as f:
        text = f.read()
    try:
        record = json.loads(text)
    except ValueError:
        raise DamagedEntry(f"{marker} is not a readable record (not JSON)") from None
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict):
        raise DamagedEntry(f"{marker} records no digest of its files (written by an older Slipway)")
    if record.get("key") != key or set(record["files"]) != set(files):
        raise DamagedEntry(f"{marker} describes another entry than requested (a hash collision or a foreign "
                           "file)")
    arrays = {}
    for name, path in files.items():
        _check_file(path, record["files"][name])
        try:
            arrays[name] = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as e:
            raise DamagedEntry(f"{path} cannot be read as .npy ({e})") from None
        if record.get("arrays", {}).get(name) != {"shape": list(arrays[name].shape),
                                                  "dtype": str(arrays[name].dtype)}:
            raise DamagedEntry(f"{path} does not have the shape and dtype {marker} records")
    return record, arrays


def load_or_build_entry(marker: str, files: dict[str, str], key: dict, cache: IndexCacheConfig,
                        build: Callable[[], tuple[dict[str, np.ndarray], dict]]
                        ) -> tuple[dict, dict[str, np.ndarray]]:
    """The entry ``marker`` names, checked against its record: the builder reuses it, or builds it with
    ``build()`` (arrays, extra record fields) when it is missing or damaged (one warning naming the file
    and the fault); every other rank waits for the builder's complete, matching entry."""
    if not cache.is_builder:
        return _wait_for_entry(marker, files, key, cache)
    try:
        return read_entry(marker, files, key)
    except FileNotFoundError:
        pass
    except DamagedEntry as problem:
        log.warning("index cache: %s; rebuilding the entry %s", problem, marker)
        with contextlib.suppress(FileNotFoundError):  # another job's builder may have removed it first
            os.unlink(marker)  # readers must not trust the old arrays while we rewrite them
    arrays, extra = build()
    write_entry(marker, files, arrays, {"key": key, **extra})
    return read_entry(marker, files, key)


def _wait_for_entry(marker: str, files: dict[str, str], key: dict, cache: IndexCacheConfig
                    ) -> tuple[dict, dict[str, np.ndarray]]:
    """A non-builder's read: poll until the entry is complete and matches its record (a damaged entry is
    the builder's to rebuild: wait for it), or fail after ``wait_timeout_s`` naming the entry and why."""
    deadline, problem = time.monotonic() + cache.wait_timeout_s, "it was never written"
    while True:
        try:
            return read_entry(marker, files, key)
        except FileNotFoundError:
            pass
        except DamagedEntry as e:
            if str(e) != problem:
                log.info("index cache: %s; waiting for the builder rank to rebuild it", e)
            problem = str(e)
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"waited {cache.wait_timeout_s:.0f} s for the index cache entry {marker}, which the builder "
                f"rank writes: {problem}. Check the builder's log for an error; if cache_dir is node-local, "
                "make local rank 0 of every node a builder, or point data.cache_dir at a folder all nodes "
                "share.")
        time.sleep(cache.poll_interval_s)


# ----------------------------------------------------------------------------------- the GPT indices

def load_or_build(sizes: np.ndarray, doc_range: tuple[int, int], spec: IndexSpec, split: str,
                  cache: IndexCacheConfig, impl: str = "auto") -> GPTIndices:
    """The indices of one split: memory-mapped from the cache (checked against the entry's digests), built
    and written first by the builder."""
    description = cache_description(sizes, doc_range, spec, split)
    paths = cache_paths(cache.cache_dir, description)
    marker, files = paths["description"], {name: paths[name] for name in _ARRAYS}
    built: list[float] = []

    def build() -> tuple[dict[str, np.ndarray], dict]:
        t0 = time.perf_counter()
        begin, end = doc_range
        indices = build_gpt_indices(sizes, np.arange(begin, end, dtype=np.int32), spec, impl=impl)
        built.append(time.perf_counter() - t0)
        return ({name: getattr(indices, name) for name in _ARRAYS},
                {"num_epochs": indices.num_epochs, "separate_last_epoch": bool(indices.separate_last_epoch)})

    record, arrays = load_or_build_entry(marker, files, description, cache, build)
    if built:
        log.info("%s indices: built in %.2f s, cached under %s", split, built[0], cache.cache_dir)
    elif cache.is_builder:
        log.info("%s indices: cache hit %s", split, marker)
    return GPTIndices(arrays["document_index"], arrays["sample_index"], arrays["shuffle_index"],
                      int(record["num_epochs"]), bool(record["separate_last_epoch"]))
