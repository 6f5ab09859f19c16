"""Megatron's weighted data blends (``--data-path 0.3 A 0.7 B``), torch-free: the ``data.paths`` spelling,
how many samples each corpus contributes, and the blended order.

The semantics are megatron-core's (``BlendedMegatronDatasetBuilder`` + ``BlendedDataset`` +
``helpers.build_blending_indices``), so a run that reads the same prefixes with the same weights, seed and
sample counts reads the same (dataset, sample) at every position:

- ``data.paths`` alternating weight and prefix is a blend (Megatron's ``get_blend_from_list``); a list
  without weights keeps Slipway's concatenation (Megatron would weight those by their lengths instead).
- weights are normalised to sum 1; per split, corpus i is asked for ``ceil(N * w_i)`` samples (the blend
  draws ``sum_i ceil(N * w_i)`` positions) and its GPT dataset is built for ``ceil(ceil(N * w_i) * 1.005)``
  (``mid_level_dataset_surplus``), the rule of megatron-core 0.13.1 and 0.16.1 (tested; 0.11/0.12 not);
  0.8.0 and 0.10.0 built ``ceil(N * w_i * 1.005)`` and drew all of them, which changes a corpus's samples
  only when the smaller count ends its GPT dataset an epoch earlier.
- position t goes to the corpus whose share lags most (``w_i * max(t, 1) - drawn_i``, lowest index on a
  tie); its sample is the next unread one of that corpus.
- ``data.split`` applies to each corpus on its own documents, as Megatron's does.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass

import numpy as np

MID_LEVEL_SURPLUS = 0.005  # megatron-core's mid_level_dataset_surplus default (0.8.0's fixed "0.5% margin")


class BlendError(ValueError):
    """A ``data.paths`` that is no blend: what is wrong (naming the entry) and how to fix it."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(f"{message}; {fix}")
        self.message, self.fix = message, fix


def _weight(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


@dataclass(frozen=True)
class Blend:
    """The corpora of ``data.paths`` and, for a weighted blend, their weights (as the user wrote them)."""

    paths: tuple[str, ...]
    weights: tuple[float, ...] | None = None

    @property
    def normalized(self) -> list[float]:
        """Weights divided by their sum (float64, as megatron.core.datasets.utils.normalize)."""
        w = np.array(self.weights, dtype=np.float64)
        return (w / w.sum()).tolist()

    def spelled(self) -> list[str]:
        """Back to ``data.paths`` (weight, path, weight, path ...) or the plain list."""
        if self.weights is None:
            return list(self.paths)
        return [x for w, p in zip(self.weights, self.paths, strict=True) for x in (repr(float(w)), p)]

    def with_paths(self, paths: list[str]) -> Blend:
        """The same weights over other paths (the preprocessed prefixes of the same inputs)."""
        return Blend(tuple(paths), self.weights)


def parse_blend(entries: list[str]) -> Blend:
    """``data.paths`` → Blend. Megatron's rule: an even-length list whose every other entry (from the
    first) is a number is weight/path pairs; no entry a number is a plain list. Raises ValueError for a
    mix, a weight <= 0, or a weight without its path, naming the entry."""
    entries = [str(e).strip() for e in entries]
    numbers = [i for i, e in enumerate(entries) if _weight(e) is not None]
    if not numbers:
        return Blend(tuple(entries))
    pairs = len(entries) % 2 == 0 and numbers == list(range(0, len(entries), 2))
    if not pairs:
        bad = next((i for i in range(len(entries)) if (i % 2 == 0) != (i in numbers)), len(entries))
        what = (f"entry {bad} ({entries[bad]!r})" if bad < len(entries)
                else f"the last entry: the weight {entries[-1]!r} has no path")
        raise BlendError(f"data.paths mixes weights and paths out of order at {what}",
                         "write weight/path pairs, e.g. data.paths=[0.3,/data/a.jsonl,0.7,/data/b.jsonl], "
                         "or paths only")
    weights = tuple(float(entries[i]) for i in numbers)
    for i, w in zip(numbers, weights, strict=True):
        if not (w > 0 and math.isfinite(w)):
            raise BlendError(f"data.paths entry {i}, the weight {entries[i]} of {entries[i + 1]!r}, is not a "
                             "finite number > 0", "raise it, or drop the pair to leave that corpus out")
    return Blend(tuple(entries[i + 1] for i in numbers), weights)


def blend_paths(entries: list[str]) -> list[str]:
    """The paths of ``data.paths`` without its weights; for a broken blend, every entry that is not a
    number (so file checks and the plan still run while the blend's own problem is reported)."""
    try:
        return list(parse_blend(entries).paths)
    except BlendError:
        return [e for e in (str(x).strip() for x in entries) if _weight(e) is None]


def target_sizes(normalized: list[float], num_samples: int, surplus: float = 0.0) -> list[int]:
    """Samples of each corpus for a blend of ``num_samples`` (megatron-core's
    ``_get_size_per_split_per_dataset``): ``ceil(ceil(N * w) * (1 + surplus))``."""
    return [int(math.ceil(math.ceil(num_samples * w) * (1 + surplus))) for w in normalized]


@dataclass(frozen=True)
class BlendSizes:
    """One split of a blend: positions drawn, samples each corpus is asked for and is built with."""

    size: int
    drawn: tuple[int, ...]
    built: tuple[int, ...]


def blend_sizes(normalized: list[float], num_samples: int) -> BlendSizes:
    drawn = target_sizes(normalized, num_samples)
    built = target_sizes(normalized, num_samples, MID_LEVEL_SURPLUS)
    return BlendSizes(sum(drawn), tuple(drawn), tuple(built))


def blending_indices(normalized: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) of ``size`` positions: Megatron's greedy rule
    (helpers.cpp ``build_blending_indices``) in float64, the same arithmetic in the same order.

    Plain Python: about 0.3 s per million positions per two corpora (CodeParrot's 28.8M: ~10-20 s, 300 MB),
    once per run on the builder rank, then cached; a C++ op beside ``build_sample_idx`` would make it ~0."""
    if len(normalized) >= 32767:
        raise ValueError(f"a blend holds at most 32766 corpora (int16 dataset index), got {len(normalized)}")
    weights = [float(w) for w in normalized]
    drawn = [0] * len(weights)
    chosen, nth = array("h"), array("q")  # compact (2 + 8 bytes a position), not lists of int objects
    rest = list(enumerate(weights))[1:]
    w0 = weights[0]
    for t in range(size):
        s = float(max(t, 1))
        best, best_err = 0, w0 * s - drawn[0]
        for i, w in rest:
            err = w * s - drawn[i]
            if err > best_err:
                best, best_err = i, err
        chosen.append(best)
        nth.append(drawn[best])
        drawn[best] += 1
    if not size:
        return np.zeros(0, np.int16), np.zeros(0, np.int64)
    return np.frombuffer(chosen, dtype=np.int16), np.frombuffer(nth, dtype=np.int64)
