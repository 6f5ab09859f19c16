"""The Megatron side of the oracle tests: run as ``python -m tests.mcore.checks NAME JSON_KWARGS`` by
``harness.run_check`` with one megatron-core version on ``sys.path``. Only Megatron's code computes here;
results go to the files named in the kwargs and one JSON line on stdout.

Nothing from ``trainer`` is imported: the expected side must not share code with what it checks.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import numpy as np


def indexed(prefixes: list[str], out: str) -> dict:
    """Megatron's IndexedDataset over .bin/.idx pairs: every sequence, the lengths, the document index
    (to ``{out}{i}.npz`` for the i-th prefix); and the documents it read written again by Megatron's
    IndexedDatasetBuilder to ``{out}{i}.bin/.idx`` (as preprocess_data.py adds them: one sequence per
    document, none for an empty one)."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    found = []
    for i, prefix in enumerate(prefixes):
        ds = IndexedDataset(prefix)
        seqs = [ds[j] for j in range(len(ds))]
        np.savez(f"{out}{i}.npz", sizes=ds.sequence_lengths, document_indices=ds.document_indices,
                 tokens=np.concatenate(seqs))
        builder = IndexedDatasetBuilder(f"{out}{i}.bin", dtype=ds.index.dtype)
        bounds = ds.document_indices
        for d in range(len(bounds) - 1):
            doc = seqs[bounds[d]:bounds[d + 1]]
            tokens = np.concatenate(doc) if doc else np.zeros(0, ds.index.dtype)
            builder.add_document(torch.from_numpy(tokens), [len(x) for x in doc])
        builder.finalize(f"{out}{i}.idx")
        found.append({"dtype": np.dtype(ds.index.dtype).name, "num_sequences": len(ds)})
    return {"datasets": found}


def gpt_datasets(prefix: str, out: str, cache: str, seq_length: int, split: str, seed: int,
                 sizes: list[int]) -> dict:
    """Megatron's BlendedMegatronDatasetBuilder + GPTDataset over one prefix, as ``--data-path PREFIX
    --split SPLIT`` builds them; each split's indices and every sample's tokens and labels."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    # The dataset reads eod (masks), pad (-1: no pad token, Megatron's default), vocab_size and the
    # identifiers that go into its cache key.
    tokenizer = SimpleNamespace(eod=0, pad=-1, vocab_size=None, unique_identifiers={"class": "oracle"})
    config = GPTDatasetConfig(random_seed=seed, sequence_length=seq_length, blend=([prefix], None),
                              split=split, path_to_cache=cache, tokenizer=tokenizer,
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                              create_attention_mask=False)
    built = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    arrays, lengths = {}, {}
    for name, ds in zip(("train", "valid", "test"), built, strict=True):
        if ds is None:
            continue
        items = [ds[i] for i in range(len(ds))]
        arrays.update({f"{name}_document_index": ds.document_index, f"{name}_sample_index": ds.sample_index,
                       f"{name}_shuffle_index": ds.shuffle_index,
                       f"{name}_tokens": np.stack([it["tokens"].numpy() for it in items]),
                       f"{name}_labels": np.stack([it["labels"].numpy() for it in items])})
        lengths[name] = len(ds)
    np.savez(out, **arrays)
    return {"lengths": lengths}


def sample_indices(cases: str, out: str) -> dict:
    """Megatron's compiled ``helpers.build_sample_idx`` on each case of the ``cases`` npz (sizes_i,
    order_i, params_i = seq_length, num_epochs, tokens_per_epoch, drop_last_partial, add_extra_token)."""
    from megatron.core.datasets import helpers

    given = np.load(cases)
    n = sum(1 for k in given.files if k.startswith("params_"))
    results, refused = {}, []
    for i in range(n):
        seq, epochs, tokens, drop_last, extra = (int(x) for x in given[f"params_{i}"])
        try:
            results[f"sample_index_{i}"] = helpers.build_sample_idx(
                given[f"sizes_{i}"], given[f"order_{i}"], seq, epochs, tokens, bool(drop_last), bool(extra))
        except AssertionError:  # >= 0.10's range check on its own output (a negative offset)
            refused.append(i)
    np.savez(out, **results)
    return {"cases": n, "refused": refused}


def data(indexed_args: dict, gpt_args: dict, sample_args: dict) -> dict:
    """The data checks in one process (an interpreter with megatron-core takes ~5 s to start)."""
    return {"indexed": indexed(**indexed_args), "gpt": gpt_datasets(**gpt_args),
            "sample": sample_indices(**sample_args)}


CHECKS = {"indexed": indexed, "gpt_datasets": gpt_datasets, "data": data}


def main(argv: list[str]) -> int:
    import megatron.core

    name, kwargs = argv[0], json.loads(argv[1])
    result = CHECKS[name](**kwargs)
    print(json.dumps({"megatron_core": megatron.core.__version__, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
