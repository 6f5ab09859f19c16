"""GPT training samples over a Megatron ``.bin/.idx`` dataset (Megatron ``GPTDataset`` semantics).

- ``split_ranges("969,30,1", n)``: document ranges of train/valid/test (cumulative fractions, each bound
  ``int(round(fraction * n))``; documents here are the index's sequences, as in Megatron's GPT path).
- ``GPTDataset``: sample i is ``S + 1`` tokens of the shuffled document stream, read across document
  boundaries through the document, sample and shuffle indices (see ``index_helpers``).
- The indices are cached as ``.npy`` (``index_cache``): built once by the caller that says it is the
  builder (rank 0), memory-mapped by every rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from trainer.data.index_cache import IndexCacheConfig, load_or_build
from trainer.data.index_helpers import GPTIndices, IndexSpec
from trainer.data.splits import DEFAULT_SPLIT, SPLIT_NAMES, megatron_num_samples, parse_split, split_ranges  # noqa: F401
from trainer.log import get_logger

log = get_logger(__name__)



class TokenSource(Protocol):
    """What GPTDataset needs from an indexed dataset (``trainer.data.indexed_dataset.IndexedDataset``)."""

    sizes: np.ndarray

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray: ...


def default_cache_dir(path_prefix: str) -> str:
    """``<dir of the data>/index-cache``; set data.cache_dir when the data folder is read-only."""
    return os.path.join(os.path.dirname(os.path.abspath(path_prefix)), "index-cache")


@dataclass(frozen=True)
class GPTDatasetConfig:
    """Settings of the GPT sample datasets (the ``data`` / ``model`` slice they need).

    seq_length: S; every sample holds S + 1 tokens (inputs = first S, labels = last S).
    seed: seed of the index shuffles (Megatron default 1234).
    split: train,valid,test weights over the documents, e.g. "969,30,1".
    cache_dir: where the index ``.npy`` files live (shared by all ranks); None = next to the data.
    wait_timeout_s: how long a non-builder rank waits for the builder's files.
    impl: sample-index builder: "auto" (C++ when built), "cpp" or "numpy".
    """

    seq_length: int
    seed: int = 1234
    split: str = DEFAULT_SPLIT
    cache_dir: str | None = None
    wait_timeout_s: float = 900.0
    impl: str = "auto"

    def __post_init__(self) -> None:
        if self.seq_length < 1:
            raise ValueError(f"GPTDatasetConfig.seq_length must be >= 1, got {self.seq_length}")
        parse_split(self.split)
        if self.impl not in ("auto", "cpp", "numpy"):
            raise ValueError(f"GPTDatasetConfig.impl must be 'auto', 'cpp' or 'numpy', got {self.impl!r}")
        if self.wait_timeout_s <= 0:
            raise ValueError(f"GPTDatasetConfig.wait_timeout_s must be > 0, got {self.wait_timeout_s}")


class GPTDataset(torch.utils.data.Dataset):
    """Fixed-length samples of ``seq_length + 1`` tokens (int64 numpy arrays) over one split."""

    def __init__(self, source: TokenSource, name: str, doc_range: tuple[int, int], indices: GPTIndices,
                 seq_length: int) -> None:
        self.source = source
        self.name = name
        self.doc_range = doc_range
        self.seq_length = seq_length
        self.document_index = indices.document_index
        self.sample_index = indices.sample_index
        self.shuffle_index = indices.shuffle_index
        self.num_epochs = indices.num_epochs

    def __len__(self) -> int:
        return int(self.sample_index.shape[0]) - 1

    def _read(self, sample_id: int) -> np.ndarray:
        """Tokens of unshuffled sample ``sample_id``: its start row up to the next row's start, inclusive."""
        beg_pos, beg_off = (int(v) for v in self.sample_index[sample_id])
        end_pos, end_off = (int(v) for v in self.sample_index[sample_id + 1])
        doc = self.document_index
        if beg_pos == end_pos:
            parts = [self.source.get(int(doc[beg_pos]), offset=beg_off, length=end_off - beg_off + 1)]
        else:
            parts = [self.source.get(int(doc[beg_pos]), offset=beg_off)]
            parts += [self.source.get(int(doc[p])) for p in range(beg_pos + 1, end_pos)]
            parts.append(self.source.get(int(doc[end_pos]), offset=0, length=end_off + 1))
        tokens = np.concatenate(parts).astype(np.int64, copy=False)
        if len(tokens) != self.seq_length + 1:
            raise RuntimeError(f"{self.name} sample {sample_id} has {len(tokens)} tokens, expected "
                               f"{self.seq_length + 1}: the cached indices do not match this data; delete "
                               "the index cache and rebuild")
        return tokens

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"{self.name} sample {i} out of range ({n} samples)")
        return self._read(int(self.shuffle_index[i % n]))

    def document_ids(self, i: int) -> list[int]:
        """Ids of the documents sample ``i`` reads from, in reading order (for inspection and tests)."""
        sample_id = int(self.shuffle_index[i])
        beg_pos, end_pos = int(self.sample_index[sample_id][0]), int(self.sample_index[sample_id + 1][0])
        return [int(d) for d in self.document_index[beg_pos:end_pos + 1]]


@dataclass(frozen=True)
class SplitRequest:
    """One split to build: its name, document range and the samples the trainer will draw (None = 1 epoch)."""

    name: str
    doc_range: tuple[int, int]
    num_samples: int | None

    def __post_init__(self) -> None:
        begin, end = self.doc_range
        if not 0 <= begin < end:
            raise ValueError(f"split {self.name!r} has the empty or invalid document range {self.doc_range}; "
                             "check data.split against the number of documents")


def build_split(source: TokenSource, request: SplitRequest, config: GPTDatasetConfig,
                cache: IndexCacheConfig) -> GPTDataset:
    """Load (or, as the builder, build and cache) the indices of one split and wrap them in a dataset."""
    begin, end = request.doc_range
    if end > len(source.sizes):
        raise ValueError(f"split {request.name!r} range {request.doc_range} exceeds the "
                         f"{len(source.sizes)} documents of the data")
    spec = IndexSpec(seq_length=config.seq_length, num_samples=request.num_samples, seed=config.seed)
    indices = load_or_build(source.sizes, request.doc_range, spec, request.name, cache, impl=config.impl)
    log.info("%s: documents [%d, %d), %d samples of %d+1 tokens, %d epoch(s)", request.name, begin, end,
             len(indices.shuffle_index), config.seq_length, indices.num_epochs)
    return GPTDataset(source, request.name, request.doc_range, indices, config.seq_length)


def build_gpt_datasets(source: TokenSource, path_prefix: str, num_samples: dict[str, int | None],
                       config: GPTDatasetConfig, is_builder: bool) -> dict[str, GPTDataset | None]:
    """Datasets for train/valid/test of one ``.bin/.idx`` prefix.

    ``num_samples[name]`` is the number of samples the trainer will draw from that split (see
    ``megatron_num_samples``); 0 or a missing name skips the split. ``is_builder``: True on exactly one
    rank that writes the cache (rank 0 for a shared cache dir); the others wait for its files.
    """
    cache = IndexCacheConfig(cache_dir=config.cache_dir or default_cache_dir(path_prefix),
                             is_builder=is_builder, wait_timeout_s=config.wait_timeout_s)
    ranges = split_ranges(config.split, len(source.sizes))
    out: dict[str, GPTDataset | None] = {}
    for name in SPLIT_NAMES:
        wanted = num_samples.get(name, 0)
        if wanted == 0:
            out[name] = None
            continue
        doc_range = ranges[name]
        if doc_range is None or doc_range[0] >= doc_range[1]:
            raise ValueError(f"{name} needs {wanted} samples but data.split={config.split!r} gives it no "
                             f"documents of {len(source.sizes)}; raise its weight or use more data")
        out[name] = build_split(source, SplitRequest(name, doc_range, wanted), config, cache)
    return out
