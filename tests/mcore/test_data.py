"""Slipway's .bin/.idx and GPTDataset indices against megatron-core's own code, version by version.

The pairs are written by Slipway's ``IndexedDatasetBuilder`` (uint16 and int32, with empty documents:
zero-sequence documents); Megatron's ``IndexedDataset`` must read every token, and Megatron's
``BlendedMegatronDatasetBuilder``/``GPTDataset`` (``--data-path PREFIX --split 90,8,2``) must build the
same document, sample and shuffle indices and the same samples as Slipway's ``build_gpt_datasets``, for a
train split that runs several epochs with a separate last epoch, and short valid/test splits.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.mcore.harness import run_check
from trainer.data.gpt_dataset import GPTDatasetConfig, build_gpt_datasets
from trainer.data.index_helpers import SampleIndexArgs, build_sample_index_cpp, build_sample_index_numpy
from trainer.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

SEQ, SEED, SPLIT = 24, 4321, "90,8,2"
SAMPLES = {"train": 300, "valid": 6, "test": 3}
DTYPES = (np.uint16, np.int32)


def corpus(dtype, n: int = 70) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 90, n)
    lengths[::7] = 0  # empty documents: kept as zero-sequence documents, as current Megatron does
    high = 65_000 if dtype == np.uint16 else 2**31 - 1
    return [rng.integers(0, high, k).astype(dtype) for k in lengths]


def random_case(rng: np.random.Generator) -> SampleIndexArgs:
    """Sample-index inputs with zero-length documents, sub-ranges (splits), 1-3 epochs, both flags."""
    num_docs = int(rng.integers(1, 40))
    sizes = rng.integers(0, int(rng.choice([3, 20, 200])), num_docs).astype(np.int32)
    sizes[rng.random(num_docs) < 0.25] = 0
    if sizes.sum() < 2:
        sizes[0] = 2
    doc_ids = np.arange(num_docs, dtype=np.int32)
    if rng.random() < 0.5:
        lo = int(rng.integers(0, num_docs))
        doc_ids = doc_ids[lo:] if sizes[lo:].sum() >= 2 else doc_ids
    epochs = int(rng.integers(1, 4))
    order = np.tile(doc_ids, epochs)
    rng.shuffle(order)
    return SampleIndexArgs(sizes, order, int(rng.choice([1, 2, 3, 7, 16, 64])), epochs,
                           int(sizes[doc_ids].sum()), bool(rng.integers(0, 2)), int(rng.integers(0, 2)))


CASES = [random_case(np.random.default_rng(1234 + i)) for i in range(300)]


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("mcore_data")
    out = []
    for dtype in DTYPES:
        prefix = str(root / f"corpus_{np.dtype(dtype).name}_text_document")
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype)
        for doc in corpus(dtype):
            builder.add_document(doc)
        builder.finalize(prefix + ".idx")
        out.append(prefix)
    return out


@pytest.fixture(scope="module")
def megatron(mcore_version, prefixes, tmp_path_factory):
    """What megatron-core ``mcore_version`` reads and builds from the pairs (one check)."""
    out = tmp_path_factory.mktemp(f"megatron_{mcore_version}")
    cases = {}
    for i, a in enumerate(CASES):
        cases.update({f"sizes_{i}": a.sizes, f"order_{i}": a.document_index, f"params_{i}": np.array(
            [a.seq_length, a.num_epochs, a.tokens_per_epoch, a.drop_last_partial, a.add_extra_token])})
    np.savez(out / "cases.npz", **cases)
    gpt = {"prefix": prefixes[0], "out": str(out / "gpt.npz"), "cache": str(out / "cache"), "seq_length": SEQ,
           "split": SPLIT, "seed": SEED, "sizes": [SAMPLES[s] for s in ("train", "valid", "test")]}
    sample = {"cases": str(out / "cases.npz"), "out": str(out / "smp.npz")}
    result = run_check(mcore_version, "data", indexed_args={"prefixes": prefixes, "out": str(out / "idx")},
                       gpt_args=gpt, sample_args=sample)
    return result, out


def test_megatron_indexed_dataset_reads_and_rewrites_slipways_pairs(prefixes, megatron):
    result, out = megatron
    for i, (dtype, prefix) in enumerate(zip(DTYPES, prefixes, strict=True)):
        theirs, docs, ours = np.load(out / f"idx{i}.npz"), corpus(dtype), IndexedDataset(prefix)
        assert result["indexed"]["datasets"][i]["dtype"] == np.dtype(dtype).name
        np.testing.assert_array_equal(theirs["document_indices"], ours.document_indices)
        np.testing.assert_array_equal(theirs["sizes"], [len(d) for d in docs if len(d)])
        np.testing.assert_array_equal(theirs["tokens"], np.concatenate(docs))
        for ext in ("bin", "idx"):  # Megatron's writer gives Slipway's bytes
            with open(f"{prefix}.{ext}", "rb") as f:
                assert (out / f"idx{i}.{ext}").read_bytes() == f.read(), (np.dtype(dtype).name, ext)


def test_megatron_gpt_dataset_equals_slipways(tmp_path, prefixes, megatron):
    result, out = megatron
    theirs = np.load(out / "gpt.npz")
    config = GPTDatasetConfig(seq_length=SEQ, split=SPLIT, seed=SEED, cache_dir=str(tmp_path / "ours"))
    ours = build_gpt_datasets(IndexedDataset(prefixes[0]), prefixes[0], SAMPLES, config, is_builder=True)
    assert ours["train"].num_epochs > 2  # several epochs (and a separate last one): the RNG order matters
    assert result["gpt"]["lengths"] == {name: len(ds) for name, ds in ours.items()}
    for name, ds in ours.items():
        for what in ("document_index", "sample_index", "shuffle_index"):
            np.testing.assert_array_equal(theirs[f"{name}_{what}"], getattr(ds, what),
                                          err_msg=f"{name} {what}")
        samples = np.stack([ds[i] for i in range(len(ds))])
        np.testing.assert_array_equal(theirs[f"{name}_tokens"], samples[:, :-1], err_msg=name)
        np.testing.assert_array_equal(theirs[f"{name}_labels"], samples[:, 1:], err_msg=name)


def test_megatron_sample_index_walk_equals_slipways(megatron):
    """Megatron's compiled build_sample_idx against Slipway's C++ op and NumPy version, on random inputs."""
    result, out = megatron
    theirs = np.load(out / "smp.npz")
    refused = result["sample"]["refused"]
    # Since 0.10 Megatron refuses its own result when a kept partial last sample would start at offset -1:
    # an order that ends on a zero-length sequence (no real .idx has one: an empty document has none).
    assert all(not CASES[i].drop_last_partial and CASES[i].sizes[CASES[i].document_index[-1]] == 0
               for i in refused), refused
    assert len(refused) < len(CASES) // 10
    for i, args in enumerate(CASES):
        if i in refused:
            continue
        expected = theirs[f"sample_index_{i}"]
        np.testing.assert_array_equal(build_sample_index_cpp(args), expected, err_msg=str(args))
        np.testing.assert_array_equal(build_sample_index_numpy(args), expected, err_msg=str(args))
