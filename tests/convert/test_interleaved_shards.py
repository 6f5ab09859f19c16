"""Interleaved (virtual pipeline) shards: which entries hold the chunks, and the refusals that name
what is wrong (trainer.checkpoint.chunks, used by the trainer's reshard and by the converters)."""

from __future__ import annotations

import argparse

import pytest

from trainer.checkpoint.chunks import chunk_entries, model_keys, virtual_size
from trainer.checkpoint.files import CheckpointError
from trainer.formulas import PipelineSplit
from trainer.restore.reshard import SourceCheckpoint


def test_keys_follow_megatron():
    assert model_keys(1) == ["model"] and model_keys(3) == ["model0", "model1", "model2"]
    assert virtual_size(argparse.Namespace(virtual_pipeline_model_parallel_size=None)) == 1
    assert virtual_size({"virtual_pipeline_model_parallel_size": 2}) == 2
    shard = {"model1": "b", "model0": "a", "args": argparse.Namespace(virtual_pipeline_model_parallel_size=2)}
    assert chunk_entries(shard, "x") == ["a", "b"]
    assert chunk_entries({"model": "m", "model0": "ignored"}, "x") == ["m"]


@pytest.mark.parametrize("shard,match", [
    ({"optimizer": {}}, "no 'model' entry"),
    ({"model0": {}, "model2": {}}, "incomplete or corrupted"),
    ({"model0": {}, "model1": {}, "args": {"virtual_pipeline_model_parallel_size": 3}}, "inconsistent"),
])
def test_refusals_name_the_problem(shard, match):
    with pytest.raises(CheckpointError, match=match):
        chunk_entries(shard, "mp_rank_00_001/model_optim_rng.pt")


def test_source_layout_must_divide(tmp_path):
    with pytest.raises(CheckpointError, match="pp_size·virtual_pp_size = 2·2 = 4"):
        SourceCheckpoint(str(tmp_path), 1, 1, PipelineSplit(6, 2, 2))
