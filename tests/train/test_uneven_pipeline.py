"""Megatron's uneven pipeline split (--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers;
parallel.first_stage_layers / last_stage_layers): the first or last stage holds a different number of
layers than the others.

- A 3-layer model at pp=2 (1 + 2, and 2 + 1) trains with the losses it has at pp=1, and saves what Megatron
  saves: each stage's layers numbered from 0, the split in args.decoder_first/last_pipeline_num_layers.
- Its checkpoint resumes at the same layout bit for bit, and reshards (weights and Adam moments) to pp=1,
  pp=3 and the other uneven split, continuing with the uninterrupted run's losses; the torch_dist format
  too.
- A checkpoint Megatron-LM saved so (written here as Megatron lays it out; tests/mcore/test_megatron_lm.py
  has Megatron-LM's own) starts a run with checkpoint.load=model-only at its own layout and at others,
  and a full resume of it (no Slipway optimizer state) says to use model-only.

Dropout is off, so every layout computes the same math (the parallel layer's parity tests); the
tolerance 1e-5 relative is test_reshard's.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.convert.conftest import random_megatron_state
from tests.train.harness import load_json, run_cfg, save_json, spawn, tiny_config, write_dataset
from trainer.checkpoint import protocol as ckpt
from trainer.checkpoint.files import CHECKPOINT_VERSION, CheckpointError, write_tracker
from trainer.convert import names
from trainer.convert.shard_io import SHARD_FILE, nest, save_shard, shard_dir_name
from trainer.convert.shards import load_merged, split
from trainer.convert.spec import GPTSpec
from trainer.model.names import layer_index, renumber

ITERS, SAVE = 6, 3
SPLITS = {"pp1": (1, None, None), "first1": (2, 1, None), "last1": (2, None, 1), "pp3": (3, None, None)}


def _config(root: Path, name: str, data: str, layout: str, **sections) -> dict:
    pp, first, last = SPLITS[layout]
    return tiny_config(str(root / name), data, model={"num_layers": 3, "hidden_dropout": 0.0,
                                                      "attention_dropout": 0.0},
                       parallel={"tp_size": 1, "pp_size": pp, "first_stage_layers": first,
                                 "last_stage_layers": last},
                       train={"iters": ITERS, "save_interval": SAVE, "micro_batch_size": 1,
                              "global_batch_size": 2, "eval_interval": None},
                       **{"checkpoint": {"keep": None}, **sections})


def _run(rank: int, d: dict, out: str) -> None:
    r = run_cfg(d)
    assert r.exit_code == 0, r
    save_json(f"{out}.{rank}", {str(k): v for k, v in r.losses.items()})


def _train(root: Path, name: str, d: dict) -> dict[int, float]:
    """The run's losses (spawned at pp > 1: the last stage's rank reports them, every rank has them)."""
    pp = d["parallel"]["pp_size"]
    if pp == 1:
        r = run_cfg(d)
        assert r.exit_code == 0, r
        return r.losses
    spawn(pp, str(root), _run, d, str(root / name))
    return {int(k): v for k, v in load_json(f"{root / name}.0").items()}


def _close(a: dict[int, float], b: dict[int, float], its) -> None:
    for i in its:
        assert abs(a[i] - b[i]) <= 1e-5 * abs(b[i]), (i, a, b)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A 3-layer run at pp=2 with 1 + 2 layers (checkpoints at 3 and 6), and the same run at pp=1."""
    root = tmp_path_factory.mktemp("uneven")
    data = write_dataset(str(root / "data"))
    losses = _train(root, "first1", _config(root, "first1", data, "first1"))
    return root, data, losses


def test_a_3_layer_model_at_pp2_trains_as_at_pp1(source):
    root, data, losses = source
    assert sorted(losses) == list(range(1, ITERS + 1))
    _close(losses, _train(root, "pp1", _config(root, "pp1", data, "pp1")), range(1, ITERS + 1))
    _close(_train(root, "last1", _config(root, "last1", data, "last1")), losses, range(1, ITERS + 1))


def test_the_checkpoint_is_megatrons_uneven_layout(source):
    root = source[0]
    iter_dir = root / "first1" / "checkpoints" / f"iter_{ITERS:07d}"
    stages = [ckpt.load_file(str(iter_dir / shard_dir_name(0, p, 2) / SHARD_FILE)) for p in range(2)]
    held = [sorted({layer_index(n) for n in nest_flat(s["model"]) if layer_index(n) is not None})
            for s in stages]
    assert held == [[0], [0, 1]]  # each stage numbers its layers from 0
    args = stages[0]["args"]
    assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers) == (1, None)
    assert load_merged(iter_dir, ITERS).state.keys() == load_merged(
        root / "pp1" / "checkpoints" / f"iter_{ITERS:07d}", ITERS).state.keys()  # converts to 3 layers


def nest_flat(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in tree.items():
        out += nest_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]
    return out


@pytest.mark.parametrize("layout", ["first1", "pp1", "last1", "pp3"])
def test_a_resume_at_any_layout_continues_the_run(source, layout):
    """From iteration 3 of the 1 + 2 run: at its own layout bit for bit, resharded elsewhere (Adam's
    moments and the schedule carried over) within 1e-5."""
    root, data, losses = source
    d = _config(root, f"resume_{layout}", data, layout)
    d["checkpoint"] = {"keep": None, "load": SAVE, "load_dir": str(root / "first1" / "checkpoints")}
    resumed = _train(root, f"resume_{layout}", d)
    assert sorted(resumed) == list(range(SAVE + 1, ITERS + 1))
    if layout == "first1":
        assert all(resumed[i] == losses[i] for i in resumed), (resumed, losses)
    _close(resumed, losses, resumed)


def test_torch_dist_saves_the_uneven_stages_and_resumes_elsewhere(source):
    root, data, losses = source
    fmt = {"checkpoint": {"keep": None, "format": "torch_dist"}}
    dist_losses = _train(root, "dist", _config(root, "dist", data, "first1", **fmt))
    assert all(dist_losses[i] == losses[i] for i in losses)
    d = _config(root, "dist_pp1", data, "pp1")
    d["checkpoint"] = {"keep": None, "load": SAVE, "load_dir": str(root / "dist" / "checkpoints")}
    _close(_train(root, "dist_pp1", d), losses, range(SAVE + 1, ITERS + 1))


def test_an_uneven_interleaved_split_trains_saves_and_reshards(source):
    """6 layers on 2 stages as 2 + 4, each stage in 2 model chunks (Megatron's
    --num-virtual-stages-per-pipeline-rank 2 --decoder-first-pipeline-num-layers 2): chunk c of stage r
    holds c·3 + (0, 1…) layers [0] [3] | [1, 2] [4, 5]; the same losses as at pp=1, and its checkpoint
    resumes there."""
    root, data, _ = source

    def cfg(name: str, pp: int, **parallel) -> dict:
        d = _config(root, name, data, "pp1")
        d["model"]["num_layers"] = 6
        d["parallel"] = {"tp_size": 1, "pp_size": pp, **parallel}
        return d

    chunked = _train(root, "vpp", cfg("vpp", 2, virtual_pp_size=2, first_stage_layers=2))
    _close(chunked, _train(root, "vpp_pp1", cfg("vpp_pp1", 1)), range(1, ITERS + 1))
    shard = ckpt.load_file(str(root / "vpp" / "checkpoints" / f"iter_{SAVE:07d}" / shard_dir_name(0, 1, 2)
                               / SHARD_FILE))
    held = [sorted({layer_index(n) for n in nest_flat(shard[f"model{c}"]) if layer_index(n) is not None})
            for c in range(2)]
    assert held == [[0, 1], [0, 1]]  # stage 1's chunks: global layers 1-2 and 4-5, numbered from 0
    a = shard["args"]
    assert (a.virtual_pipeline_model_parallel_size, a.num_virtual_stages_per_pipeline_rank,
            a.num_layers_per_virtual_pipeline_stage, a.decoder_first_pipeline_num_layers) == (2, 2, None, 2)
    resumed = cfg("vpp_resume", 1)
    resumed["checkpoint"] = {"keep": None, "load": SAVE, "load_dir": str(root / "vpp" / "checkpoints")}
    _close(_train(root, "vpp_resume", resumed), chunked, range(SAVE + 1, ITERS + 1))


# A checkpoint as Megatron-LM saves a 4-layer model with --decoder-first-pipeline-num-layers 1 at pp=2.
FIRST = 1
SPEC = GPTSpec(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=128,
               max_position_embeddings=16, vocab_size=200, padded_vocab_size=256)


def write_uneven(ckpt_dir: Path, state: dict[str, torch.Tensor]) -> None:
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
        save_shard(ckpt_dir / "iter_0000010" / shard_dir_name(0, p, 2) / SHARD_FILE,
                   {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 10,
                    "model": nest(stage)})
    write_tracker(str(ckpt_dir), 10)


def _megatron_config(tmp: Path, ckpt_dir: Path, name: str, pp: int, first: int | None,
                     load: str = "model-only") -> dict:
    """One step at learning rate 0 (warm-up: step 1 of 4 starts at 0) brings the weights back bit for bit:
    the run loaded exactly the checkpoint's layers in the right order."""
    return tiny_config(str(tmp / name), write_dataset(str(tmp / "data")),
                       model={"num_layers": 4, "hidden_dropout": 0.0, "attention_dropout": 0.0},
                       parallel={"tp_size": 1, "pp_size": pp, "first_stage_layers": first},
                       optim={"warmup_iters": 4},
                       train={"micro_batch_size": 1, "global_batch_size": 2, "iters": 1,
                              "eval_interval": None},
                       checkpoint={"load": load, "load_dir": str(ckpt_dir)})


@pytest.fixture(scope="module")
def megatron_uneven(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_uneven")
    state = random_megatron_state(SPEC, seed=5)
    write_uneven(root / "megatron", state)
    return root, state


@pytest.mark.parametrize("pp,first", [(2, FIRST), (1, None), (2, None)], ids=["own-1+3", "pp1", "pp2-2+2"])
def test_an_uneven_megatron_checkpoint_starts_a_run_at_its_own_layout_and_others(megatron_uneven, pp, first):
    root, state = megatron_uneven
    assert load_merged(root / "megatron" / "iter_0000010", 10).state.keys() == state.keys()  # it converts
    name = f"run_pp{pp}_{first}"
    _train(root, name, _megatron_config(root, root / "megatron", name, pp, first))
    saved = load_merged(root / name / "checkpoints" / "iter_0000001", 1).state
    assert saved.keys() == state.keys()
    for n, t in state.items():
        assert torch.equal(saved[n], t), n


def test_a_full_resume_of_a_megatron_uneven_checkpoint_says_model_only(megatron_uneven):
    from tests.train.test_reshard import _load
    from trainer.parallel import ParallelState

    root, _ = megatron_uneven
    d = _megatron_config(root, root / "megatron", "full", 1, None, load="latest")
    with pytest.raises(CheckpointError, match="no optimizer.*checkpoint.load=model-only"):
        _load(copy.deepcopy(d), ParallelState.single())
