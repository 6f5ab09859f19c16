"""Micro-batch sampling over a GPTDataset, sharded across data-parallel ranks, resumable.

Megatron's pretraining sampler: the dataset is already shuffled (its shuffle index), so the sampler walks
dataset positions ``consumed_samples, consumed_samples + 1, ...``; every step takes ``micro_batch * dp``
consecutive positions and DP rank r gets the r-th slice of ``micro_batch``. Resuming a run is restoring
``consumed_samples`` (the trainer checkpoints it); the following batches are identical to an unbroken run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SamplerConfig:
    """Where to start and how to shard.

    total_samples: dataset length (positions ``[0, total_samples)`` are valid).
    consumed_samples: positions already used by earlier steps (all DP ranks together); resume point.
    micro_batch_size: samples per rank per micro-batch.
    dp_rank: this rank's index in the data-parallel group, 0 <= dp_rank < dp_size.
    dp_size: data-parallel world size.
    drop_last: drop a trailing incomplete step (else each rank gets its part of it, possibly empty).
    """

    total_samples: int
    consumed_samples: int
    micro_batch_size: int
    dp_rank: int = 0
    dp_size: int = 1
    drop_last: bool = True

    def __post_init__(self) -> None:
        if self.total_samples <= 0:
            raise ValueError(f"SamplerConfig.total_samples must be > 0, got {self.total_samples}")
        if self.micro_batch_size <= 0 or self.dp_size <= 0:
            raise ValueError(f"SamplerConfig: micro_batch_size ({self.micro_batch_size}) and dp_size "
                             f"({self.dp_size}) must be > 0")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"SamplerConfig.dp_rank={self.dp_rank} outside [0, dp_size={self.dp_size})")
        if not 0 <= self.consumed_samples < self.total_samples:
            raise ValueError(f"SamplerConfig.consumed_samples={self.consumed_samples} outside [0, "
                             f"{self.total_samples}): the run has used up its data; build the dataset with "
                             "more samples (train.iters * global_batch_size) or restart from 0")


class PretrainingSampler:
    """Yields, per step, this DP rank's list of dataset positions (usable as a DataLoader batch_sampler)."""

    def __init__(self, config: SamplerConfig) -> None:
        self.config = config
        self.step_size = config.micro_batch_size * config.dp_size

    def __len__(self) -> int:
        remaining = self.config.total_samples - self.config.consumed_samples
        return remaining // self.step_size if self.config.drop_last else -(-remaining // self.step_size)

    def _slice(self, step_start: int, step_end: int) -> list[int]:
        lo = step_start + self.config.dp_rank * self.config.micro_batch_size
        hi = min(lo + self.config.micro_batch_size, step_end)
        return list(range(lo, hi))

    def __iter__(self) -> Iterator[list[int]]:
        cfg = self.config
        start = cfg.consumed_samples
        while start + self.step_size <= cfg.total_samples:
            yield self._slice(start, start + self.step_size)
            start += self.step_size
        if start < cfg.total_samples and not cfg.drop_last:
            yield self._slice(start, cfg.total_samples)


def collate_samples(samples: Sequence[np.ndarray]) -> dict[str, torch.Tensor]:
    """Stack S+1-token samples into ``tokens`` [b, S+1] int64, ``inputs`` [b, S] and ``labels`` [b, S]."""
    if len(samples) == 0:
        raise ValueError("collate_samples got an empty micro-batch")
    tokens = torch.from_numpy(np.stack([np.asarray(s, dtype=np.int64) for s in samples]))
    return {"tokens": tokens, "inputs": tokens[:, :-1], "labels": tokens[:, 1:]}


def micro_batches(dataset: Sequence[np.ndarray], config: SamplerConfig) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's micro-batches in order, starting after ``config.consumed_samples`` (in-process reads)."""
    for positions in PretrainingSampler(config):
        if positions:
            yield collate_samples([dataset[i] for i in positions])


def build_dataloader(dataset: torch.utils.data.Dataset, config: SamplerConfig,
                     num_workers: int = 0) -> torch.utils.data.DataLoader:
    """A DataLoader over the same micro-batches as ``micro_batches`` with background reader workers."""
    return torch.utils.data.DataLoader(dataset, batch_sampler=PretrainingSampler(config),
                                       num_workers=num_workers, collate_fn=collate_samples,
                                       pin_memory=False, persistent_workers=num_workers > 0)
