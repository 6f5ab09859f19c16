"""Index math, unit level: the C++ op == the NumPy version; epochs; the last-epoch rule; dtypes.

Megatron itself (its compiled build_sample_idx and GPTDataset, every version in the matrix) is the oracle
in tests/mcore/test_data.py; this file only checks Slipway's two implementations against each other."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer import extension as _ext
from trainer.data.index_helpers import (
    IndexSpec,
    SampleIndexArgs,
    build_document_index,
    build_gpt_indices,
    build_sample_index,
    build_sample_index_cpp,
    build_sample_index_numpy,
    build_shuffle_index,
    count_epochs,
    last_epoch_plan,
    sample_index_dtype,
)

needs_ext = pytest.mark.skipif(not _ext.load(), reason="trainer._C not built (make install)")


def random_args(rng: np.random.Generator) -> SampleIndexArgs:
    num_docs = int(rng.integers(1, 40))
    sizes = rng.integers(0, int(rng.choice([3, 20, 200])), num_docs).astype(np.int32)
    sizes[rng.random(num_docs) < 0.25] = 0  # zero-length documents
    if sizes.sum() < 2:
        sizes[0] = 2
    doc_ids = np.arange(num_docs, dtype=np.int32)
    if rng.random() < 0.5:  # a split: a sub-range of the documents
        lo = int(rng.integers(0, num_docs))
        doc_ids = doc_ids[lo:] if sizes[lo:].sum() >= 2 else doc_ids
    epochs = int(rng.integers(1, 4))
    order = np.tile(doc_ids, epochs)
    rng.shuffle(order)
    tokens = int(sizes[doc_ids].sum())
    return SampleIndexArgs(sizes, order, int(rng.choice([1, 2, 3, 7, 16, 64])), epochs, tokens,
                           bool(rng.integers(0, 2)), int(rng.integers(0, 2)))


@needs_ext
def test_cpp_equals_numpy_on_random_inputs():
    rng = np.random.default_rng(1234)
    for _ in range(600):
        args = random_args(rng)
        got_np = build_sample_index_numpy(args)
        got_cpp = build_sample_index_cpp(args)
        assert got_cpp.dtype == got_np.dtype == np.int32
        np.testing.assert_array_equal(got_cpp, got_np, err_msg=str(args))


@needs_ext
def test_cpp_equals_numpy_on_a_large_index():
    rng = np.random.default_rng(7)
    sizes = rng.integers(0, 3000, 200_000).astype(np.int32)
    order = np.tile(np.arange(len(sizes), dtype=np.int32), 3)
    rng.shuffle(order)
    for seq, extra in ((2048, 1), (1024, 0), (333, 1)):
        args = SampleIndexArgs(sizes, order, seq, 3, int(sizes.sum(dtype=np.int64)), True, extra)
        np.testing.assert_array_equal(build_sample_index_cpp(args), build_sample_index_numpy(args))


@needs_ext
def test_cpp_int64_output_matches_int32():
    rng = np.random.default_rng(3)
    args = random_args(rng)
    sizes, order = torch.from_numpy(args.sizes), torch.from_numpy(args.document_index)
    call = (args.seq_length, args.num_epochs, args.tokens_per_epoch, args.drop_last_partial,
            args.add_extra_token)
    small = torch.ops.slipway.build_sample_idx(sizes, order, *call, False)
    big = torch.ops.slipway.build_sample_idx(sizes, order, *call, True)
    assert small.dtype == torch.int32 and big.dtype == torch.int64
    assert torch.equal(small.long(), big)


def test_sample_index_dtype_rule():
    sizes = np.array([5, 7], dtype=np.int32)
    assert sample_index_dtype(sizes, np.zeros(10, np.int32)) == np.int32
    huge_order = np.broadcast_to(np.int32(0), (2**31 + 5,))  # no memory: a zero-stride view
    assert sample_index_dtype(sizes, huge_order) == np.int64


@needs_ext
def test_overstated_token_count_is_an_error_not_a_crash():
    sizes = np.array([4, 4], dtype=np.int32)
    args = SampleIndexArgs(sizes, np.array([0, 1], np.int32), 2, 1, 40, True, 1)
    with pytest.raises(RuntimeError, match="fewer tokens"):
        build_sample_index_cpp(args)
    with pytest.raises(ValueError, match="fewer"):
        build_sample_index_numpy(args)
    bad = SampleIndexArgs(sizes, np.array([0, 5], np.int32), 2, 1, 8, True, 1)
    with pytest.raises(RuntimeError, match="outside sizes"):
        build_sample_index_cpp(bad)


def test_dispatch_rejects_unknown_impl():
    args = SampleIndexArgs(np.array([9], np.int32), np.array([0], np.int32), 2, 1, 9)
    with pytest.raises(ValueError, match="impl"):
        build_sample_index(args, impl="fortran")


def test_count_epochs_matches_megatron_loop():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        tokens, seq = int(rng.integers(2, 5000)), int(rng.integers(1, 300))
        samples = int(rng.integers(0, 400))
        epochs, total = 1, tokens  # Megatron: grow until E*T >= N*S + 1
        while total < samples * seq + 1:
            epochs, total = epochs + 1, total + tokens
        assert count_epochs(tokens, IndexSpec(seq, samples)) == epochs
    assert count_epochs(100, IndexSpec(8, None)) == 1
    with pytest.raises(ValueError, match="too few"):
        count_epochs(1, IndexSpec(8, 10))


def test_separate_last_epoch_threshold_boundary():
    tokens, seq = 1001, 10  # (T-1)//S = 100 samples per epoch; int(0.8 * 100) = 80
    for from_last, separate in ((79, True), (80, False), (100, False), (1, True)):
        samples = 100 + from_last  # sans_last for E=2 is (T-1)//S = 100
        spec = IndexSpec(seq, samples)
        epochs = count_epochs(tokens, spec)
        assert epochs == 2
        assert last_epoch_plan(tokens, epochs, spec) == (separate, 100)
    assert last_epoch_plan(tokens, 1, IndexSpec(seq, 50)) == (False, 0)


def test_separate_last_epoch_structure():
    sizes = np.full(20, 10, dtype=np.int32)  # 200 tokens per epoch, (200-1)//10 = 19 samples per epoch
    doc_ids = np.arange(20, dtype=np.int32)
    spec = IndexSpec(seq_length=10, num_samples=19 * 2 + 3, seed=1)  # 3 from the last epoch: separate
    got = build_gpt_indices(sizes, doc_ids, spec)
    assert got.num_epochs == 3 and got.separate_last_epoch
    first, last = got.document_index[:40], got.document_index[40:]
    assert np.array_equal(np.bincount(first, minlength=20), np.full(20, 2))  # two whole epochs mixed
    assert np.array_equal(np.sort(last), doc_ids)  # the last epoch alone
    sans = (2 * 200 - 1) // 10
    shuffle = got.shuffle_index.astype(np.int64)
    assert np.array_equal(np.sort(shuffle[:sans]), np.arange(sans))
    assert np.array_equal(np.sort(shuffle[sans:]), np.arange(sans, len(shuffle)))
    mixed = build_gpt_indices(sizes, doc_ids, IndexSpec(10, 19 * 2 + 17, seed=1))  # 17 >= int(0.8*19)=15
    assert mixed.num_epochs == 3 and not mixed.separate_last_epoch


def test_document_and_shuffle_index_helpers():
    rng = np.random.RandomState(5)
    order = build_document_index(np.array([3, 4, 5]), 4, rng, separate_last_epoch=True)
    assert order.dtype == np.int32 and len(order) == 12
    assert sorted(order[9:].tolist()) == [3, 4, 5]
    shuffle = build_shuffle_index(10, 10, np.random.RandomState(0))
    assert shuffle.dtype == np.uint32 and sorted(shuffle.tolist()) == list(range(10))
