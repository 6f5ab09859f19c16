"""The train/valid/test split, Megatron's rule, torch-free: the trainer builds its datasets with it and the
plan checks with it that every split the run draws from gets documents (``orchestrator/checks/data.py``).
"""

from __future__ import annotations

import math
import re

SPLIT_NAMES = ("train", "valid", "test")
DEFAULT_SPLIT = "969,30,1"  # train,valid,test weights over the documents: the HF guide's CodeParrot split


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` -> normalised ``[0.969, 0.03, 0.001]``; missing trailing parts are 0."""
    parts = [p.strip() for p in re.split(r"[,/]", split.strip())]
    if not 1 <= len(parts) <= 3 or any(not p for p in parts):
        raise ValueError(f"data.split={split!r}: expected 1 to 3 comma-separated weights for "
                         "train,valid,test, e.g. '969,30,1'")
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"data.split={split!r}: every part must be a number, e.g. '969,30,1'") from None
    if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
        raise ValueError(f"data.split={split!r}: weights must be finite, >= 0 and not all 0")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return [w / total for w in weights]


def split_ranges(split: str, num_docs: int) -> dict[str, tuple[int, int] | None]:
    """Document range ``[begin, end)`` per split; None for a split whose weight is 0.

    Megatron's rule: bookends are the cumulative sums of the normalised weights, and each bound is
    ``int(round(bookend * num_docs))`` (so ranges tile ``[0, num_docs)`` exactly).
    """
    if num_docs < 0:
        raise ValueError(f"num_docs must be >= 0, got {num_docs}")
    fractions = parse_split(split)
    out: dict[str, tuple[int, int] | None] = {}
    low = 0.0
    for name, fraction in zip(SPLIT_NAMES, fractions, strict=True):
        high = low + fraction
        if fraction > 0:
            out[name] = (int(round(low * float(num_docs))), int(round(high * float(num_docs))))
        else:
            out[name] = None
        low = high
    return out


def megatron_num_samples(train_iters: int, global_batch_size: int, eval_interval: int,
                         eval_iters: int) -> dict[str, int]:
    """Samples per split as Megatron requests them: train = iters*gbs; valid covers every evaluation."""
    evals = (train_iters // eval_interval + 1) * eval_iters if eval_interval > 0 else 0
    return {"train": train_iters * global_batch_size, "valid": evals * global_batch_size,
            "test": eval_iters * global_batch_size}


def samples_drawn(train_iters: int, global_batch_size: int, eval_interval: int | None,
                  eval_iters: int) -> dict[str, int]:
    """Samples the trainer draws per split: Megatron's counts, without the test split (the trainer never
    tests) and without validation when it never evaluates."""
    wants = megatron_num_samples(train_iters, global_batch_size, eval_interval or 0, eval_iters)
    wants.pop("test")
    if not (eval_interval and eval_iters):
        wants["valid"] = 0
    return wants
