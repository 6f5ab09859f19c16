"""A run starts from Megatron-LM's own checkpoints (checkpoint.load=model-only) at another layout, and a
run saved in Megatron-core format (checkpoint.format=mcore) resumes exactly.

Oracle: ``../shared/fixtures/megatron`` (written by Megatron-LM core_v0.8.0, with the logits Megatron
computed). A run loads a fixture at a (tp, pp) the fixture was not saved at, takes steps with a learning
rate too small to change an fp32 weight (1e-30), saves; that Slipway checkpoint, converted to Hugging Face,
must give Megatron's logits. A second run with a real learning rate shows the loaded model trains on.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.fixtures import MEGATRON_FIXTURES as FIXTURES
from tests.train.harness import run_cfg, spawn, tiny_config, write_dataset
from trainer.convert.to_hf import ToHFConfig, convert_checkpoint
from trainer.metrics_file import TRAIN_LOSS, series

# Each fixture → a layout it was not saved at.
TARGET = {"legacy_tp1_pp1": (2, 1), "legacy_tp1_pp2": (1, 1), "legacy_tp2_pp1": (1, 2),
          "mcore_tp1_pp1": (1, 2), "mcore_tp2_pp1": (1, 1), "mcore_tp2_pp2": (1, 1),
          "mcore_torch_dist": (2, 1), "mcore_torch_dist_tp2": (1, 1)}


def _config(tmp: Path, fixture: str, tp: int, pp: int, lr: float, iters: int) -> dict:
    data = write_dataset(str(tmp / "data"))
    tok = FIXTURES / "tokenizer"
    return tiny_config(
        str(tmp / "run"), data,
        model={"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
               "max_position_embeddings": 64, "vocab_size": 1024, "hidden_dropout": 0.0,
               "attention_dropout": 0.0},
        parallel={"tp_size": tp, "pp_size": pp},
        optim={"lr": lr, "min_lr": 0.0, "warmup_iters": 0, "weight_decay": 0.0},
        train={"iters": iters, "save_interval": iters, "eval_interval": 1000, "log_interval": 1},
        tokenizer={"vocab_file": str(tok / "vocab.json"), "merge_file": str(tok / "merges.txt")},
        checkpoint={"load": "model-only", "load_dir": str(FIXTURES / fixture), "keep": 1},
        kernels="eager")


def _run(rank: int, d: dict) -> None:
    run_cfg(d)


def _train(tmp: Path, d: dict) -> None:
    world = d["parallel"]["tp_size"] * d["parallel"]["pp_size"]
    if world == 1:
        run_cfg(d)
    else:
        spawn(world, str(tmp), _run, d)


@pytest.mark.parametrize("fixture", sorted(TARGET))
def test_a_run_starts_from_megatrons_weights_at_another_layout(tmp_path, fixture):
    from transformers import GPT2LMHeadModel

    tp, pp = TARGET[fixture]
    d = _config(tmp_path, fixture, tp, pp, lr=1e-30, iters=2)
    _train(tmp_path, d)
    ckpt = Path(d["run_dir"]) / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"  # the run's own count
    tok = FIXTURES / "tokenizer"
    convert_checkpoint(ToHFConfig(ckpt, tmp_path / "hf", vocab_file=tok / "vocab.json",
                                  merge_file=tok / "merges.txt"))
    expected = torch.load(FIXTURES / fixture / "expected.pt", weights_only=True)
    with torch.no_grad():
        logits = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()(expected["tokens"]).logits
    assert (logits - expected["logits"]).abs().max().item() <= 1e-4


def test_the_loaded_megatron_model_trains_on(tmp_path):
    d = _config(tmp_path, "mcore_tp2_pp2", 1, 1, lr=3e-3, iters=12)
    run_cfg(d)
    losses = [loss for _, loss in series(d["run_dir"], TRAIN_LOSS)]
    assert len(losses) == 12 and all(map(torch.isfinite, torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3


def test_an_mcore_format_run_resumes_exactly(tmp_path):
    """checkpoint.format=mcore: the shards hold Megatron-core names, and resuming from them reproduces an
    uninterrupted run's losses bit for bit."""
    data = write_dataset(str(tmp_path / "data"))
    cadence, schedule = {"iters": 12, "save_interval": 6, "log_interval": 1}, {"decay_iters": 12}
    full = tiny_config(str(tmp_path / "full"), data, train=cadence, optim=schedule)
    run_cfg(full)
    half = tiny_config(str(tmp_path / "half"), data, checkpoint={"format": "mcore", "keep": 2},
                       train={**cadence, "iters": 6}, optim=schedule)  # stops at 6, then resumes to 12
    run_cfg(half)
    shard = torch.load(os.path.join(half["run_dir"], "checkpoints", "iter_0000006", "mp_rank_00",
                                    "model_optim_rng.pt"), weights_only=False)
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in shard["model"]
    assert shard["args"].use_legacy_models is False
    run_cfg({**half, "train": {**half["train"], "iters": 12}})
    assert series(half["run_dir"], TRAIN_LOSS) == series(full["run_dir"], TRAIN_LOSS)


def test_a_saved_mcore_shard_has_megatron_cores_keys_and_shapes(tmp_path):
    """What a real run writes with checkpoint.format=mcore, against the genuine Megatron-core shard."""
    from trainer.checkpoint import pickles

    d = _config(tmp_path, "mcore_tp1_pp1", 1, 1, lr=1e-30, iters=1)
    d["checkpoint"]["format"] = "mcore"
    run_cfg(d)
    ours = pickles.load(os.path.join(d["run_dir"], "checkpoints", "iter_0000001", "mp_rank_00",
                                     "model_optim_rng.pt"))
    theirs = pickles.load(str(FIXTURES / "mcore_tp1_pp1" / "iter_0000007" / "mp_rank_00" /
                              "model_optim_rng.pt"))

    def shapes(model: dict) -> dict:
        return {k: None if v is None else tuple(v.shape) for k, v in model.items()}

    assert shapes(ours["model"]) == shapes(theirs["model"])
    assert set(theirs) - {"num_floating_point_operations_so_far"} <= set(ours)
    assert ours["checkpoint_version"] == theirs["checkpoint_version"] == 3.0
