"""Sampler: resuming from consumed_samples gives the same batches; DP shards are disjoint and covering."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.data.sampler import (
    PretrainingSampler,
    SamplerConfig,
    build_dataloader,
    collate_samples,
    micro_batches,
)


class Rows(torch.utils.data.Dataset):
    """Sample i = [i, i+1, ..., i+S] so a batch shows which positions it holds."""

    def __init__(self, n: int, seq: int) -> None:
        self.n, self.seq = n, seq

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.arange(i, i + self.seq + 1, dtype=np.int64)


def rank_batches(total, consumed, mb, dp, rank, drop_last=True):
    return list(PretrainingSampler(SamplerConfig(total, consumed, mb, rank, dp, drop_last)))


@pytest.mark.parametrize("total,mb,dp", [(100, 2, 4), (97, 3, 2), (64, 1, 1), (50, 4, 3)])
def test_dp_shards_are_disjoint_and_cover_each_step(total, mb, dp):
    per_rank = [rank_batches(total, 0, mb, dp, r) for r in range(dp)]
    steps = total // (mb * dp)
    assert all(len(b) == steps == len(PretrainingSampler(SamplerConfig(total, 0, mb, r, dp)))
               for r, b in enumerate(per_rank))
    for step in range(steps):
        parts = [per_rank[r][step] for r in range(dp)]
        assert all(len(p) == mb for p in parts)
        flat = [i for p in parts for i in p]
        assert flat == list(range(step * mb * dp, (step + 1) * mb * dp))  # disjoint, covering, rank order


def test_resume_from_consumed_samples_gives_the_same_batches():
    ds = Rows(200, seq=8)
    mb, dp = 3, 2
    for rank in range(dp):
        full = list(micro_batches(ds, SamplerConfig(len(ds), 0, mb, rank, dp)))
        for k in (0, 1, 5, 20):
            resumed = list(micro_batches(ds, SamplerConfig(len(ds), k * mb * dp, mb, rank, dp)))
            assert len(resumed) == len(full) - k
            for a, b in zip(full[k:], resumed, strict=True):
                assert torch.equal(a["tokens"], b["tokens"])


def test_partial_last_step_when_not_dropping():
    parts = [rank_batches(10, 0, 2, 3, r, drop_last=False) for r in range(3)]
    assert [p[-1] for p in parts] == [[6, 7], [8, 9], []]
    assert sorted(i for p in parts for b in p for i in b) == list(range(10))
    assert len(PretrainingSampler(SamplerConfig(10, 0, 2, 0, 3, drop_last=False))) == 2


def test_micro_batches_are_inputs_and_shifted_labels():
    ds = Rows(40, seq=5)
    batch = next(micro_batches(ds, SamplerConfig(40, 6, 4, 1, 2)))
    assert batch["tokens"].shape == (4, 6) and batch["tokens"].dtype == torch.int64
    assert batch["tokens"][:, 0].tolist() == [10, 11, 12, 13]  # step at 6: rank 1 takes 6+4 .. 6+8
    assert torch.equal(batch["inputs"], batch["tokens"][:, :-1])
    assert torch.equal(batch["labels"], batch["tokens"][:, 1:])
    assert torch.equal(batch["labels"][:, :-1], batch["inputs"][:, 1:])


def test_dataloader_matches_in_process_batches():
    ds = Rows(30, seq=4)
    cfg = SamplerConfig(30, 4, 2, 0, 2)
    loaded = list(build_dataloader(ds, cfg, num_workers=0))
    direct = list(micro_batches(ds, cfg))
    assert len(loaded) == len(direct) == 6
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(loaded, direct, strict=True))


@pytest.mark.parametrize("kwargs,match", [
    (dict(total_samples=10, consumed_samples=10, micro_batch_size=1), "used up"),
    (dict(total_samples=10, consumed_samples=0, micro_batch_size=1, dp_rank=2, dp_size=2), "dp_rank"),
    (dict(total_samples=10, consumed_samples=0, micro_batch_size=0), "micro_batch_size"),
])
def test_invalid_configs_say_what_is_wrong(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplerConfig(**kwargs)
    with pytest.raises(ValueError, match="empty"):
        collate_samples([])
