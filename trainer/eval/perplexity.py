"""Perplexity of a Hugging Face causal LM: on the held-out split of the run's ``.bin/.idx`` data (read with
the trainer's own dataset code, so the converted model is checked end to end against the numbers
training saw) and on JSONL files.

Perplexity is exp(mean next-token negative log-likelihood) over every scored token.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

from trainer.convert.hf_io import hf_positions
from trainer.data.gpt_dataset import GPTDatasetConfig, SplitRequest, build_split
from trainer.data.index_cache import IndexCacheConfig
from trainer.data.indexed_dataset import IndexedDataset
from trainer.data.splits import split_ranges


@dataclass(frozen=True)
class HeldOut:
    """Where the held-out samples come from: a dataset prefix, the training split and sample length."""

    prefix: str
    split: str
    seq_length: int
    seed: int = 1234
    cache_dir: str | None = None  # index files of this one-epoch view (default: <prefix dir>/index-cache)


def _score(model, batch: torch.Tensor, device: torch.device) -> tuple[float, int]:
    """(summed NLL, tokens) of rows of S+1 tokens: inputs the first S, labels the last S."""
    batch = batch.to(device)
    with torch.no_grad():
        inputs = batch[:, :-1]  # whole rows, no padding: every position attends
        logits = model(inputs, attention_mask=torch.ones_like(inputs)).logits.float()
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                            reduction="sum")
    return float(nll), int(batch[:, 1:].numel())


def _result(nll: float, tokens: int, **extra) -> dict:
    loss = nll / max(tokens, 1)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens, **extra}


def heldout_perplexity(model, data: HeldOut, max_samples: int, device: torch.device, batch_size: int = 8
                       ) -> dict | None:
    """Perplexity on the first ``max_samples`` samples of the test split (the valid split when the test
    split is empty); None when neither has documents."""
    source = IndexedDataset(data.prefix)
    ranges = split_ranges(data.split, len(source.sizes))
    name = next((n for n in ("test", "valid") if ranges.get(n) and ranges[n][0] < ranges[n][1]), None)
    if name is None:
        return None
    n_pos = hf_positions(model.config)
    seq = min(data.seq_length, n_pos)
    cfg = GPTDatasetConfig(seq_length=seq, seed=data.seed, split=data.split, cache_dir=data.cache_dir)
    cache = IndexCacheConfig(cache_dir=data.cache_dir or os.path.join(os.path.dirname(data.prefix),
                                                                      "index-cache"), is_builder=True)
    dataset = build_split(source, SplitRequest(name, ranges[name], None), cfg, cache)
    count = min(max_samples, len(dataset))
    nll, tokens = 0.0, 0
    for i in range(0, count, batch_size):
        rows = torch.stack([torch.from_numpy(dataset[j]) for j in range(i, min(i + batch_size, count))])
        a, b = _score(model, rows, device)
        nll, tokens = nll + a, tokens + b
    return _result(nll, tokens, split=name, samples=count, seq_length=seq, prefix=data.prefix)


def jsonl_perplexity(model, tokenizer, path: str, key: str, max_docs: int, device: torch.device) -> dict:
    """Perplexity over the ``key`` text of the first ``max_docs`` lines of ``path``, each document scored
    in windows of the model's positions (EOD appended, as preprocessing does)."""
    n_pos = hf_positions(model.config)
    nll, tokens, docs = 0.0, 0, 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if docs >= max_docs:
                break
            if not line.strip():
                continue
            text = json.loads(line).get(key)
            if not isinstance(text, str):
                raise ValueError(f"{path}: line {docs + 1} has no string field {key!r} (data.json_key)")
            ids = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
            docs += 1
            for start in range(0, len(ids) - 1, n_pos):
                window = torch.tensor([ids[start:start + n_pos + 1]])
                if window.shape[1] > 1:
                    a, b = _score(model, window, device)
                    nll, tokens = nll + a, tokens + b
    return _result(nll, tokens, documents=docs, path=path)
