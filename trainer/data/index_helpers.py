"""The three GPT index arrays (document, sample, shuffle) with Megatron ``GPTDataset`` semantics.

Facts carried over from Megatron-LM (``megatron/core/datasets/gpt_dataset.py`` and ``helpers.cpp``), so that
a run reading the same ``.bin/.idx`` with the same seed sees the same samples in the same order:

- one ``numpy.random.RandomState(seed)`` is drawn from in this order: document-index shuffle (first the
  E-1 full epochs, then the separate last epoch when there is one), then the shuffle index (first range,
  then the separate last range);
- the document index is int32; the shuffle index is uint32 unless the sample count needs int64;
- the sample index is int32 unless ``max(len(document_index), max(sizes))`` exceeds int32, then int64;
- the last epoch is shuffled on its own when it supplies fewer than ``int(0.8 * samples_per_epoch)``.

The sample index is built by the C++ op ``torch.ops.slipway.build_sample_idx`` (csrc/helpers.cpp); the
NumPy reference here derives the same rows independently (cumulative sums + searchsorted) and serves as
the fallback when the extension is missing.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from trainer.log import get_logger

log = get_logger(__name__)

# Megatron's threshold: a last epoch supplying less than this fraction of an epoch is shuffled separately,
# so that the early epochs are not mixed with a partial one.
SEPARATE_LAST_EPOCH_THRESHOLD = 0.80
_INT32_MAX = int(np.iinfo(np.int32).max)


@dataclass(frozen=True)
class IndexSpec:
    """What determines the indices of one split, besides the sequence lengths and document ids.

    seq_length: S, tokens per sample input (each sample reads S + add_extra_token tokens).
    num_samples: samples the caller will draw; None means exactly one epoch.
    seed: seed of the single ``numpy.random.RandomState`` used for both shuffles (Megatron default 1234).
    add_extra_token: 1 for GPT (inputs = first S tokens, labels = last S); 0 reads exactly S tokens.
    drop_last_partial: drop a trailing sample shorter than S + add_extra_token (Megatron's default).
    """

    seq_length: int
    num_samples: int | None
    seed: int = 1234
    add_extra_token: int = 1
    drop_last_partial: bool = True

    def __post_init__(self) -> None:
        if self.seq_length < 1:
            raise ValueError(f"IndexSpec.seq_length must be >= 1, got {self.seq_length}")
        if self.num_samples is not None and self.num_samples < 0:
            raise ValueError(f"IndexSpec.num_samples must be >= 0 or None, got {self.num_samples}")
        if self.add_extra_token not in (0, 1):
            raise ValueError(f"IndexSpec.add_extra_token must be 0 or 1, got {self.add_extra_token}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"IndexSpec.seed must be in [0, 2**32) for numpy RandomState, got {self.seed}")


@dataclass
class GPTIndices:
    """The three arrays plus the derived facts that produced them."""

    document_index: np.ndarray  # int32 [E * D]: document ids in reading order
    sample_index: np.ndarray  # int32/int64 [num_samples + 1, 2]: (position in document_index, offset)
    shuffle_index: np.ndarray  # uint32/int64 [num_samples]: dataset position -> sample id
    num_epochs: int
    separate_last_epoch: bool


def count_epochs(tokens_per_epoch: int, spec: IndexSpec) -> int:
    """Smallest E >= 1 with ``E * T >= N * S + add_extra_token`` (1 when num_samples is None)."""
    if tokens_per_epoch <= spec.add_extra_token:
        raise ValueError(f"the split holds {tokens_per_epoch} tokens: too few to build even one sample; "
                         "give the split more documents (data.split) or use more data")
    if spec.num_samples is None:
        return 1
    needed = spec.num_samples * spec.seq_length + spec.add_extra_token
    return max(1, -(-needed // tokens_per_epoch))


def last_epoch_plan(tokens_per_epoch: int, num_epochs: int, spec: IndexSpec) -> tuple[bool, int]:
    """(separate the last epoch?, samples in the first E-1 epochs), per Megatron's 80% rule."""
    if num_epochs == 1 or spec.num_samples is None:
        return False, 0
    a, s = spec.add_extra_token, spec.seq_length
    sans_last = ((num_epochs - 1) * tokens_per_epoch - a) // s
    from_last = spec.num_samples - sans_last
    per_epoch = (tokens_per_epoch - a) // s
    return from_last < int(SEPARATE_LAST_EPOCH_THRESHOLD * per_epoch), sans_last


def build_document_index(doc_ids: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_last_epoch: bool) -> np.ndarray:
    """E copies of ``doc_ids`` shuffled together (or E-1 together, then the last one on its own)."""
    if not separate_last_epoch or num_epochs == 1:
        order = np.tile(np.asarray(doc_ids).astype(np.int32), num_epochs)
        rng.shuffle(order)
        return order
    first = build_document_index(doc_ids, num_epochs - 1, rng, False)
    last = build_document_index(doc_ids, 1, rng, False)
    return np.concatenate((first, last))


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Permutation of ``[0, num_samples)`` followed by a permutation of ``[num_samples, total_size)``."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def sample_index_dtype(sizes: np.ndarray, document_index: np.ndarray) -> np.dtype:
    """int32 when every position and offset fits, else int64 (Megatron's rule)."""
    biggest = max(len(document_index), int(sizes.max()) if len(sizes) else 0)
    return np.dtype(np.int32) if biggest <= _INT32_MAX else np.dtype(np.int64)


def _num_samples(usable_tokens: int, seq_length: int, drop_last_partial: bool) -> int:
    if drop_last_partial:
        return usable_tokens // seq_length
    return -(-usable_tokens // seq_length)


@dataclass(frozen=True)
class SampleIndexArgs:
    """Inputs of the sample-index walk (both implementations take exactly these)."""

    sizes: np.ndarray  # int32 [num sequences]
    document_index: np.ndarray  # int32 [E * D]
    seq_length: int
    num_epochs: int
    tokens_per_epoch: int
    drop_last_partial: bool = True
    add_extra_token: int = 1


def build_sample_index_numpy(args: SampleIndexArgs) -> np.ndarray:
    """Reference: sample i starts at stream token i*S; find its document by searchsorted on cumulative ends.

    Sample i's start row is the document holding the last token the previous sample consumed
    (token ``i*S + add_extra_token - 1``), so empty documents are never a start, exactly like the C++ walk.
    """
    a, s = args.add_extra_token, args.seq_length
    usable = args.num_epochs * args.tokens_per_epoch - a
    if usable < 0:
        raise ValueError(f"{args.num_epochs} epochs of {args.tokens_per_epoch} tokens hold no sample")
    n = _num_samples(usable, s, args.drop_last_partial)
    lengths = args.sizes[args.document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    starts = np.arange(n + 1, dtype=np.int64) * s
    pos = np.searchsorted(ends, starts + (a - 1), side="right")
    off = np.empty_like(starts)
    inside = pos < len(ends)
    off[inside] = starts[inside] - (ends[pos[inside]] - lengths[pos[inside]])
    run_off = np.flatnonzero(~inside[1:]) + 1
    if len(run_off) and (run_off[0] != n or args.drop_last_partial):
        raise ValueError(f"the document order holds {int(ends[-1]) if len(ends) else 0} tokens, fewer than "
                         f"tokens_per_epoch * num_epochs = {args.tokens_per_epoch * args.num_epochs} claims")
    if len(run_off):  # trailing partial sample ran past the last document (drop_last_partial=False)
        pos[n] = len(ends) - 1
        off[n] = int(args.sizes[args.document_index[-1]]) - a
    pos[0], off[0] = 0, 0
    out = np.stack((pos, off), axis=1)
    return out.astype(sample_index_dtype(args.sizes, args.document_index), copy=False)


def build_sample_index_cpp(args: SampleIndexArgs) -> np.ndarray:
    """The C++ walk (torch.ops.slipway.build_sample_idx); raises if the extension is not built."""
    from trainer import extension as _ext

    if not _ext.load():
        raise RuntimeError("trainer._C is not built; run `make install` (or use impl='numpy')")
    out_int64 = sample_index_dtype(args.sizes, args.document_index) == np.int64
    sizes = np.ascontiguousarray(args.sizes, dtype=np.int32)
    doc = np.ascontiguousarray(args.document_index, dtype=np.int32)
    with warnings.catch_warnings():
        # Memory-mapped sizes are read-only; the op only reads, so sharing the buffer is safe.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        out = torch.ops.slipway.build_sample_idx(
            torch.from_numpy(sizes), torch.from_numpy(doc), args.seq_length, args.num_epochs,
            args.tokens_per_epoch, args.drop_last_partial, args.add_extra_token, out_int64)
    return out.numpy()


def build_sample_index(args: SampleIndexArgs, impl: str = "auto") -> np.ndarray:
    """Dispatch: ``cpp``, ``numpy`` or ``auto`` (C++ when the extension is built, else NumPy)."""
    if impl not in ("auto", "cpp", "numpy"):
        raise ValueError(f"impl must be 'auto', 'cpp' or 'numpy', got {impl!r}")
    if impl == "numpy":
        return build_sample_index_numpy(args)
    if impl == "auto":
        from trainer import extension as _ext

        if not _ext.load():
            return build_sample_index_numpy(args)
    return build_sample_index_cpp(args)


def build_gpt_indices(sizes: np.ndarray, doc_ids: np.ndarray, spec: IndexSpec,
                      impl: str = "auto") -> GPTIndices:
    """All three indices for the documents ``doc_ids`` (ids into ``sizes``), Megatron's RandomState order."""
    doc_ids = np.asarray(doc_ids)
    if len(doc_ids) == 0:
        raise ValueError("the split has no documents; check data.split (e.g. '969,30,1') against the data")
    tokens_per_epoch = int(np.sum(sizes[doc_ids], dtype=np.int64))
    num_epochs = count_epochs(tokens_per_epoch, spec)
    separate, sans_last = last_epoch_plan(tokens_per_epoch, num_epochs, spec)
    rng = np.random.RandomState(spec.seed)
    document_index = build_document_index(doc_ids, num_epochs, rng, separate)
    sample_index = build_sample_index(
        SampleIndexArgs(sizes, document_index, spec.seq_length, num_epochs, tokens_per_epoch,
                        spec.drop_last_partial, spec.add_extra_token), impl)
    total = sample_index.shape[0] - 1
    shuffle_index = build_shuffle_index(sans_last if separate else total, total, rng)
    log.debug("indices: %d tokens/epoch, %d epochs, separate last epoch %s, %d samples",
              tokens_per_epoch, num_epochs, separate, total)
    return GPTIndices(document_index, sample_index, shuffle_index, num_epochs, separate)
