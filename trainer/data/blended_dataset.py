"""A weighted blend of GPT datasets (megatron-core ``BlendedDataset`` semantics; the rules are in
:mod:`trainer.data.blend`).

Each corpus gets its own train/valid GPT datasets (its own ``data.split`` of its documents, its own index
cache), sized for its share; the blend's two arrays — which corpus, which of its samples, per position —
are built once by the builder rank and cached next to the GPT indices (``data.cache_dir``, Megatron's
``--data-cache-path``), then memory-mapped by every rank. Position i of the blend is a pure function of
the data, weights, seed and sample counts, so a resumed run (the sampler restarts at
``consumed_samples``) reads the same sequence as an unbroken one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from trainer.data.blend import blend_sizes, blending_indices
from trainer.data.gpt_dataset import (
    GPTDataset,
    GPTDatasetConfig,
    TokenSource,
    build_gpt_datasets,
    default_cache_dir,
)
from trainer.data.index_cache import IndexCacheConfig, cache_key, load_or_build_entry
from trainer.data.splits import SPLIT_NAMES
from trainer.log import get_logger

log = get_logger(__name__)

BLEND_ALGORITHM_VERSION = "slipway-blend-1"
_ARRAYS = ("dataset_index", "dataset_sample_index")


class BlendedDataset(torch.utils.data.Dataset):
    """Position i → sample ``dataset_sample_index[i]`` of corpus ``dataset_index[i]``."""

    def __init__(self, name: str, datasets: list[GPTDataset], dataset_index: np.ndarray,
                 dataset_sample_index: np.ndarray) -> None:
        self.name = name
        self.datasets = datasets
        self.dataset_index = dataset_index
        self.dataset_sample_index = dataset_sample_index
        drawn = np.bincount(np.asarray(dataset_index, dtype=np.int64), minlength=len(datasets))
        for k, (dataset, n) in enumerate(zip(datasets, drawn, strict=True)):
            if n > len(dataset):
                raise IndexError(f"the {name} blend draws {n} samples from corpus {k} ({dataset.name}), "
                                 f"which holds {len(dataset)}: its index cache does not match this blend; "
                                 "delete data.cache_dir's files for it and rebuild")

    def __len__(self) -> int:
        return int(self.dataset_index.shape[0])

    def position(self, i: int) -> tuple[int, int]:
        """(corpus, sample of that corpus) read at position ``i``."""
        return int(self.dataset_index[i]), int(self.dataset_sample_index[i])

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"{self.name} blend position {i} out of range ({n} positions)")
        corpus, sample = self.position(i % n)
        return self.datasets[corpus][sample]


@dataclass(frozen=True)
class BlendRequest:
    """The corpora of one blend: their readers, prefixes and normalised weights."""

    sources: list[TokenSource]
    prefixes: list[str]
    weights: list[float]

    def __post_init__(self) -> None:
        if not (len(self.sources) == len(self.prefixes) == len(self.weights) >= 1):
            raise ValueError(f"a blend needs one source, prefix and weight per corpus, got "
                             f"{len(self.sources)}, {len(self.prefixes)} and {len(self.weights)}")


def _load_or_build_indices(weights: list[float], size: int, split: str, cache: IndexCacheConfig
                           ) -> tuple[np.ndarray, np.ndarray]:
    """The blend's two arrays, an index cache entry like the GPT indices' (checked against its digests;
    built by the builder rank, waited for by the others)."""
    description = {"algorithm": BLEND_ALGORITHM_VERSION, "split": split, "weights": weights, "size": size}
    base = os.path.join(cache.cache_dir, f"{cache_key(description)}-blend-{split}")
    files = {name: f"{base}-{name}.npy" for name in _ARRAYS}

    def build() -> tuple[dict[str, np.ndarray], dict]:
        t0 = time.perf_counter()
        arrays = dict(zip(_ARRAYS, blending_indices(weights, size), strict=True))
        log.info("%s blend indices: %d positions built in %.2f s", split, size, time.perf_counter() - t0)
        return arrays, {}

    _, arrays = load_or_build_entry(f"{base}-description.json", files, description, cache, build)
    if any(a.shape != (size,) for a in arrays.values()):
        raise ValueError(f"the blend indices of {base}-description.json are not {size} long: delete the "
                         "entry's files to rebuild")
    return arrays["dataset_index"], arrays["dataset_sample_index"]


def build_blended_datasets(request: BlendRequest, num_samples: dict[str, int | None],
                           config: GPTDatasetConfig, is_builder: bool) -> dict[str, BlendedDataset | None]:
    """Blended train/valid/test: per split of ``num_samples`` (0 or missing: skipped), every corpus's GPT
    dataset of its share, then the blend of ``sum(ceil(N * w))`` positions."""
    sizes = {name: blend_sizes(request.weights, n) for name in SPLIT_NAMES if (n := num_samples.get(name, 0))}
    corpora: list[dict[str, GPTDataset | None]] = []
    for k, (source, prefix) in enumerate(zip(request.sources, request.prefixes, strict=True)):
        wants = {name: s.built[k] for name, s in sizes.items()}
        try:
            corpora.append(build_gpt_datasets(source, prefix, wants, config, is_builder))
        except ValueError as err:
            raise ValueError(f"blend corpus {k} ({prefix}): {err}") from err
    cache = IndexCacheConfig(cache_dir=config.cache_dir or default_cache_dir(request.prefixes[0]),
                             is_builder=is_builder, wait_timeout_s=config.wait_timeout_s)
    out: dict[str, BlendedDataset | None] = dict.fromkeys(SPLIT_NAMES)
    for name, s in sizes.items():
        index, sample_index = _load_or_build_indices(request.weights, s.size, name, cache)
        out[name] = BlendedDataset(name, [c[name] for c in corpora], index, sample_index)
        shares = ", ".join(f"{n} of {p}" for n, p in zip(s.drawn, request.prefixes, strict=True))
        log.info("%s blend: %d positions (%s)", name, s.size, shares)
    return out
