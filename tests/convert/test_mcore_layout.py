"""A Slipway shard in Megatron-core format has exactly the keys and shapes Megatron-core writes: compared
with the genuine fixtures (../shared/fixtures/megatron/mcore_*), stage by stage, tp shard by tp shard."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.fixtures import MEGATRON_FIXTURES as FIXTURES
from trainer.checkpoint import pickles
from trainer.config.model import ModelConfig
from trainer.convert.mcore import gpt_flat, to_mcore_model
from trainer.formulas import PipelineSplit
from trainer.model.gpt import GPT, StageSpec
from trainer.parallel.apply import apply_tensor_parallel, stage_spec
from trainer.parallel.random import RNGTracker
from trainer.parallel.state import Group

# The fixtures' model (their README): 2 layers, hidden 64, 4 heads, ffn 256, 64 positions, vocab 1024.
CFG = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=1024,
                hidden_dropout=0.0, attention_dropout=0.0)


def _shard_model(tp: int, tp_rank: int, stage: StageSpec) -> GPT:
    with torch.device("meta"):
        model = GPT(CFG, stage, padded_vocab_size=CFG.padded_vocab_size(tp), kernels="eager")
        if tp > 1:
            pstate = SimpleNamespace(tp_size=tp, tp_group=Group(tuple(range(tp)), index=tp_rank))
            apply_tensor_parallel(model, pstate, sequence_parallel=False, tracker=RNGTracker())
    return model


def _shape(v):
    return None if v is None else tuple(v.shape)


@pytest.mark.parametrize("name,tp,pp", [("mcore_tp1_pp1", 1, 1), ("mcore_tp2_pp1", 2, 1),
                                        ("mcore_tp2_pp2", 2, 2)])
def test_slipway_mcore_shards_match_megatron_cores(name, tp, pp):
    for t in range(tp):
        for p in range(pp):
            folder = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
            path = FIXTURES / name / "iter_0000007" / folder / "model_optim_rng.pt"
            theirs = pickles.load(str(path))["model"]
            stage = stage_spec(PipelineSplit(CFG.num_layers, pp), p)
            model = _shard_model(tp, t, stage)
            flat = {n: p_.detach() for n, p_ in model.named_parameters()}
            ours = to_mcore_model(flat, stage.post_process)  # local layer numbers, as Megatron saves
            assert {k: _shape(v) for k, v in ours.items()} == {k: _shape(v) for k, v in theirs.items()}, \
                folder
            assert list(ours) == list(theirs), folder  # Megatron-core's order too


def test_reading_back_either_format_gives_the_gpts_names():
    path = FIXTURES / "mcore_tp1_pp1" / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt"
    theirs = pickles.load(str(path))
    flat = gpt_flat(theirs["model"])
    model = _shard_model(1, 0, stage_spec(PipelineSplit(2, 1), 0))
    assert {n: tuple(v.shape) for n, v in flat.items()} == \
        {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert gpt_flat(to_mcore_model(flat, post_process=True)).keys() == flat.keys()
