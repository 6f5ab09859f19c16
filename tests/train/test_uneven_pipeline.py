"""A checkpoint saved with Megatron's uneven pipeline split (--decoder-first-pipeline-num-layers 1: the
first stage holds 1 layer, the last 3, each numbering its layers from 0) starts a run with
checkpoint.load=model-only at other layouts and at its own (tp, pp), as to_hf already converts it; a
full resume is refused with the setting to use.

A learning rate of 0 for the one step (warm-up: step 1 of 4 starts at 0) brings the weights back bit
for bit: the run loaded exactly the checkpoint's layers in the right order.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.convert.conftest import random_megatron_state
from tests.train.harness import run_cfg, spawn, tiny_config, write_dataset
from trainer.checkpoint.files import CHECKPOINT_VERSION, write_tracker
from trainer.convert import names
from trainer.convert.shard_io import SHARD_FILE, nest, save_shard, shard_dir_name
from trainer.convert.shards import load_merged, split
from trainer.convert.spec import GPTSpec
from trainer.model.names import layer_index, renumber

FIRST = 1  # layers on the first of 2 stages; the other 3 on the last
SPEC = GPTSpec(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=128,
               max_position_embeddings=16, vocab_size=200, padded_vocab_size=256)


def write_uneven(ckpt: Path, state: dict[str, torch.Tensor]) -> None:
    """Two stages as Megatron saves an uneven split: local layer numbers, the tied head copy last."""
    stages: list[dict[str, torch.Tensor]] = [{}, {}]
    for name, t in split(state, 1, 1)[(0, 0)].items():
        i = layer_index(name)
        if i is not None:
            p = 0 if i < FIRST else 1
            stages[p][renumber(name, -FIRST if p else 0)] = t
        elif name.startswith("language_model.embedding."):
            stages[0][name] = t
            if name == names.WORD_EMBEDDINGS:
                stages[1][names.HEAD_EMBEDDINGS] = t
        else:
            stages[1][name] = t
    args = {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 128,
            "seq_length": 16, "max_position_embeddings": 16, "padded_vocab_size": 256, "vocab_size": 200,
            "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2,
            "decoder_first_pipeline_num_layers": FIRST, "decoder_last_pipeline_num_layers": None}
    for p, stage in enumerate(stages):
        save_shard(ckpt / "iter_0000010" / shard_dir_name(0, p, 2) / SHARD_FILE,
                   {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 10,
                    "model": nest(stage)})
    write_tracker(ckpt, 10)


def _run(rank: int, cfg: dict) -> None:
    assert run_cfg(cfg).exit_code == 0


def _config(tmp: Path, ckpt: Path, pp: int, load: str = "model-only") -> dict:
    return tiny_config(str(tmp / f"run_pp{pp}"), write_dataset(str(tmp / "data")),
                       model={"num_layers": 4, "hidden_dropout": 0.0, "attention_dropout": 0.0},
                       parallel={"tp_size": 1, "pp_size": pp}, optim={"warmup_iters": 4},
                       train={"micro_batch_size": 1, "global_batch_size": 2, "iters": 1,
                              "eval_interval": None},
                       checkpoint={"load": load, "load_dir": str(ckpt)})


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    root = tmp_path_factory.mktemp("uneven")
    state = random_megatron_state(SPEC, seed=5)
    write_uneven(root / "megatron", state)
    return root, state


@pytest.mark.parametrize("pp", [1, 2])
def test_an_uneven_split_starts_a_run_at_any_layout(uneven, pp):
    root, state = uneven
    assert load_merged(root / "megatron" / "iter_0000010", 10).state.keys() == state.keys()  # it converts
    spawn(pp, str(root), _run, _config(root, root / "megatron", pp))
    saved = load_merged(root / f"run_pp{pp}" / "checkpoints" / "iter_0000001", 1).state
    assert saved.keys() == state.keys()
    for name, t in state.items():
        assert torch.equal(saved[name], t), name


def test_a_full_resume_of_an_uneven_split_names_the_setting(uneven):
    from trainer.checkpoint.files import CheckpointError
    from trainer.config.model import ModelConfig
    from trainer.run.entry import _load_checkpoint

    root, _ = uneven
    gpt = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=200,
                    max_position_embeddings=16, ffn_hidden_size=128)
    with pytest.raises(CheckpointError, match="uneven pipeline split.*checkpoint.load=model-only"):
        _load_checkpoint((str(root / "megatron"), 10, False), gpt, None, None)
