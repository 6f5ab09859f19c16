"""GPTDataset end to end on a real .bin/.idx pair written by IndexedDatasetBuilder."""

from __future__ import annotations

import numpy as np

from trainer.data.gpt_dataset import GPTDatasetConfig, build_gpt_datasets
from trainer.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from trainer.data.sampler import SamplerConfig, micro_batches


def write_pair(prefix: str, docs: list[np.ndarray]) -> IndexedDataset:
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for doc in docs:
        builder.add_document(doc)
    builder.finalize(prefix + ".idx")
    return IndexedDataset(prefix)


def test_samples_from_a_real_index_reconstruct_the_token_stream(tmp_path):
    rng = np.random.default_rng(11)
    lengths = rng.integers(1, 120, 80)
    lengths[::9] = 0  # empty documents become zero-sequence documents (no sequence id)
    docs = [rng.integers(0, 65_000, n).astype(np.uint16) for n in lengths]
    data = write_pair(str(tmp_path / "corpus_text_document"), docs)
    config = GPTDatasetConfig(seq_length=32, split="90,10,0", cache_dir=str(tmp_path / "cache"))
    sets = build_gpt_datasets(data, data.path_prefix, {"train": 400, "valid": 10}, config, is_builder=True)
    train = sets["train"]
    assert train.num_epochs > 1 and len(train) >= 400
    sequences = [d.astype(np.int64) for d in docs if len(d)]  # GPT splits and reads by sequence id
    assert len(data.sizes) == len(sequences) < len(docs)
    stream = np.concatenate([sequences[int(s)] for s in train.document_index])
    for i in range(0, len(train), 7):
        sid = int(train.shuffle_index[i])
        np.testing.assert_array_equal(train[i], stream[sid * 32: sid * 32 + 33])

    # Another rank opens its own reader and memory-maps the same cached indices.
    other = build_gpt_datasets(IndexedDataset(data.path_prefix), data.path_prefix,
                               {"train": 400, "valid": 10}, config, is_builder=False)["train"]
    batch = next(micro_batches(other, SamplerConfig(len(other), 8, 4, dp_rank=1, dp_size=2)))
    assert batch["inputs"].shape == (4, 32) and batch["labels"].shape == (4, 32)
    np.testing.assert_array_equal(batch["tokens"][0].numpy(), train[12])
