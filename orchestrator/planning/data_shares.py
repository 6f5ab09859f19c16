"""What a weighted blend (``data.paths=[0.3,a.jsonl,0.7,b.jsonl]``) makes of the run's tokens, for the plan:
each corpus's share of the training samples (Megatron's ``ceil(N * w)``, :mod:`trainer.data.blend`) and
how many epochs of its training split that is.

A corpus's token count is exact once its preprocessing is cached (the ``_summary.json`` next to the
prefix); before that it is estimated from the file's size at ``BYTES_PER_TOKEN`` (GPT-2 BPE on English
and code is 3.5-4.5 bytes a token) and shown with ``~``; a compressed file has no estimate.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from orchestrator.base.schema import SlipwayConfig
from trainer.data.blend import BlendError, target_sizes
from trainer.data.splits import parse_split
from trainer.run_files import preprocess_summary

BYTES_PER_TOKEN = 4.0


@dataclass(frozen=True)
class CorpusShare:
    path: str
    weight: float  # normalised
    samples: int  # training samples drawn from this corpus
    tokens: int  # samples * seq_length
    epochs: float | None  # of this corpus's training split; None when its size is unknown
    exact: bool  # epochs from the preprocessed token count (else from the file size)


def _corpus_tokens(path: str, prefix: str, json_key: str) -> tuple[int | None, bool]:
    try:
        with open(preprocess_summary(prefix), encoding="utf-8") as f:
            return int(json.load(f)["tokens"][json_key]), True
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if path.endswith(".gz") or not os.path.isfile(path):
        return None, False
    return int(os.path.getsize(path) / BYTES_PER_TOKEN), False


def corpus_shares(cfg: SlipwayConfig, global_batch: int, prefixes: list[str]) -> list[CorpusShare]:
    """One row per corpus of a weighted blend (none for plain paths or a broken blend); ``prefixes``: the
    preprocess outputs of the same inputs, in order."""
    try:
        blend = cfg.data.blend()
    except BlendError:
        return []
    if blend.weights is None or cfg.data.corpus is not None:
        return []
    weights = blend.normalized
    samples = target_sizes(weights, cfg.train.iters * global_batch)
    train_fraction = parse_split(cfg.data.split)[0]
    out = []
    for path, prefix, w, n in zip(blend.paths, prefixes, weights, samples, strict=True):
        tokens, exact = _corpus_tokens(path, prefix, cfg.data.json_key)
        train_tokens = (tokens or 0) * train_fraction
        epochs = n * cfg.model.seq_length / train_tokens if train_tokens else None
        out.append(CorpusShare(path, w, n, n * cfg.model.seq_length, epochs, exact))
    return out


def shares_table(shares: list[CorpusShare]) -> list[str]:
    if not shares:
        return []
    total = sum(s.tokens for s in shares)
    lines = ["", "Data blend (share of the training tokens; epochs of each corpus's train split):"]
    for s in shares:
        epochs = ("? (size known once preprocessed)" if s.epochs is None
                  else f"{'' if s.exact else '~'}{s.epochs:.2f} epochs")
        lines.append(f"  {s.tokens / total:6.1%}  (weight {s.weight:.3f}) {s.tokens / 1e6:10.2f} M tokens  "
                     f"{epochs:<16}  {s.path}")
    if not all(s.exact for s in shares):
        lines.append(f"  (~: estimated from the file size at {BYTES_PER_TOKEN:g} bytes per token)")
    return lines
