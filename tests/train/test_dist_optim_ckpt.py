"""distrib_optim.pt: the distributed optimizer's checkpoint is independent of dp and of the option.

A dp=2 run with optim.distributed saves at iteration 4 (``distrib_optim.pt`` beside each shard, in the
manifest, ``args.use_distributed_optimizer``); from it, runs resume exactly at dp=2 and continue at dp=4
and, without the option, at dp=1 (2→4, 2→1, distributed→non-distributed). A non-distributed dp=2
checkpoint resumes with the option at dp=1 (non-distributed→distributed). A continued run must match the
uninterrupted one closely, which it cannot with fresh Adam moments (the first step after a reset moves
every weight by ~lr).
"""

import os

import torch

from tests.train.harness import load_json, run_cfg, save_json, spawn, tiny_config, write_dataset
from trainer.checkpoint import verify as ckpt_verify
from trainer.checkpoint.protocol import load_file, shard_path

ITERS, SAVE_AT = 8, 4


def _cfg(tmp_path, name: str, data: str, distributed: bool, dp: int, **extra) -> dict:
    # dropout off: the dropout RNG streams belong to the saved dp ranks; micro 1 so dp=4 fits gbs 4
    return tiny_config(str(tmp_path / name), data,
                       model={"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
                              "vocab_size": 200, "hidden_dropout": 0.0, "attention_dropout": 0.0},
                       optim={"lr": 1e-2, "min_lr": 1e-3, "warmup_iters": 2, "weight_decay": 0.1,
                              "distributed": distributed},
                       train={"micro_batch_size": 1, "global_batch_size": 4, "iters": ITERS,
                              "save_interval": SAVE_AT, "eval_interval": None, "log_interval": 4,
                              "deterministic": True, "device": "cpu"},
                       **extra)


def _run(rank: int, d: dict, out: str) -> None:
    r = run_cfg(d)
    save_json(f"{out}.{rank}", {str(k): v for k, v in r.losses.items()})


def _resume_from(cfg: dict, src: dict) -> dict:
    return {**cfg, "checkpoint": {"keep": 2, "load": SAVE_AT, "load_dir": os.path.join(src["run_dir"],
                                                                                       "checkpoints")}}


def _losses(tmp_path, world: int, d: dict, tag: str) -> dict:
    spawn(world, str(tmp_path), _run, d, str(tmp_path / tag))
    return load_json(f"{tmp_path / tag}.0")


def _close(got: dict, ref: dict, rtol: float) -> None:
    for k, v in got.items():
        assert abs(v - ref[k]) <= rtol * abs(ref[k]), (k, v, ref[k], got, ref)


def test_distributed_checkpoint_loads_at_any_dp_and_across_the_option(tmp_path):
    data = write_dataset(str(tmp_path / "data"))
    dist2 = _cfg(tmp_path, "dist2", data, True, 2)
    ref = _losses(tmp_path, 2, dist2, "dist2")
    ckpt = os.path.join(dist2["run_dir"], "checkpoints")
    shard_dir = os.path.dirname(shard_path(ckpt, SAVE_AT, 0, 0, 1))
    distrib = load_file(os.path.join(shard_dir, "distrib_optim.pt"))
    shard = load_file(os.path.join(shard_dir, "model_optim_rng.pt"))
    assert shard["args"].use_distributed_optimizer is True
    assert shard["optimizer"]["optimizer"]["distributed"] and not shard["optimizer"]["optimizer"]["state"]
    assert distrib["step"] == SAVE_AT and distrib["dp_size"] == 2
    names = shard["optimizer"]["param_names"]
    assert sorted(distrib["state"]) == sorted(names)
    emb = distrib["state"]["embedding.word_embeddings.weight"]
    assert emb["param"].dtype == torch.float32 and emb["exp_avg_sq"].abs().sum() > 0
    manifest = ckpt_verify.read_manifest(os.path.dirname(shard_dir))
    assert "mp_rank_00/distrib_optim.pt" in manifest["files"]
    assert ckpt_verify.problems(os.path.dirname(shard_dir), "model_optim_rng.pt") == []

    exact = _losses(tmp_path, 2, _resume_from(_cfg(tmp_path, "exact", data, True, 2), dist2), "exact")
    assert exact == {k: ref[k] for k in exact} and sorted(map(int, exact)) == [5, 6, 7, 8]
    _close(_losses(tmp_path, 4, _resume_from(_cfg(tmp_path, "dp4", data, True, 4), dist2), "dp4"), ref, 1e-5)
    plain1 = _resume_from(_cfg(tmp_path, "plain1", data, False, 1), dist2)
    _close(_losses(tmp_path, 1, plain1, "plain1"), ref, 1e-5)

    plain2 = _cfg(tmp_path, "plain2", data, False, 2)
    ref_plain = _losses(tmp_path, 2, plain2, "plain2")
    to_dist = _resume_from(_cfg(tmp_path, "todist", data, True, 1), plain2)
    _close(_losses(tmp_path, 1, to_dist, "todist"), ref_plain, 1e-5)


def test_bf16_distributed_resumes_exactly(tmp_path):
    """16-bit weights in the model entry, fp32 masters in distrib_optim.pt: a resume is bit-exact."""
    data = write_dataset(str(tmp_path / "data"))
    src = _cfg(tmp_path, "bf16", data, True, 2)
    src["train"]["precision"] = "bf16"
    ref = _losses(tmp_path, 2, src, "bf16")
    ckpt = os.path.join(src["run_dir"], "checkpoints")
    shard = load_file(shard_path(ckpt, SAVE_AT, 0, 0, 1))
    assert shard["args"].params_dtype == "bfloat16"
    assert shard["model"]["language_model"]["embedding"]["word_embeddings"]["weight"].dtype == torch.bfloat16
    resumed = _resume_from(_cfg(tmp_path, "bf16b", data, True, 2), src)
    resumed["train"]["precision"] = "bf16"
    got = _losses(tmp_path, 2, resumed, "bf16b")
    assert got == {k: ref[k] for k in got} and sorted(map(int, got)) == [5, 6, 7, 8]


FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "fixtures", "megatron")


def test_megatron_weights_become_the_masters(tmp_path):
    """A model-only start from Megatron-LM's own checkpoint (it has no distrib_optim.pt: written with
    --no-save-optim) with bf16 + optim.distributed: the fp32 masters follow the loaded weights (Megatron's
    reload_model_params), not the initialisation."""
    from trainer.convert.mcore import gpt_flat

    fixture = os.path.join(FIXTURES, "legacy_tp1_pp1")
    tok = os.path.join(FIXTURES, "tokenizer")
    d = tiny_config(str(tmp_path / "run"), write_dataset(str(tmp_path / "data")),
                    model={"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
                           "max_position_embeddings": 64, "vocab_size": 1024, "hidden_dropout": 0.0,
                           "attention_dropout": 0.0},
                    optim={"lr": 1e-30, "min_lr": 0.0, "warmup_iters": 0, "weight_decay": 0.0,
                           "distributed": True},
                    train={"iters": 2, "save_interval": 2, "eval_interval": None, "precision": "bf16",
                           "device": "cpu", "deterministic": True, "micro_batch_size": 1,
                           "global_batch_size": 2},
                    tokenizer={"vocab_file": os.path.join(tok, "vocab.json"),
                               "merge_file": os.path.join(tok, "merges.txt")},
                    checkpoint={"load": "model-only", "load_dir": fixture, "keep": 1})
    spawn(2, str(tmp_path), _run, d, str(tmp_path / "fixture"))
    saved = load_file(os.path.join(d["run_dir"], "checkpoints", "iter_0000002", "mp_rank_00",
                                   "distrib_optim.pt"))["state"]
    megatron = gpt_flat(load_file(os.path.join(fixture, "iter_0000007", "mp_rank_00",
                                               "model_optim_rng.pt"))["model"])
    for name in ("encoder.layers.0.mlp.dense_h_to_4h.weight", "embedding.word_embeddings.weight"):
        want = megatron[name].float()
        torch.testing.assert_close(saved[name]["param"], want, rtol=1e-2, atol=2e-3 * want.abs().max().item())


def test_distributed_checkpoint_reshards_across_tp_and_pp(tmp_path):
    """Saved at (tp, pp, dp) = (1, 2, 2) with the option; continued at (2, 1, 1) without it and at
    (1, 1, 2) with it: the reshard path reads distrib_optim.pt's masters and moments by name. A damaged
    distrib_optim.pt fails verification."""
    data = write_dataset(str(tmp_path / "data"))
    src = _cfg(tmp_path, "pp2", data, True, 2)
    src["parallel"] = {"tp_size": 1, "pp_size": 2}
    ref = _losses(tmp_path, 4, src, "pp2")
    tp2 = _resume_from(_cfg(tmp_path, "tp2", data, False, 1), src)
    tp2["parallel"] = {"tp_size": 2, "pp_size": 1}
    _close(_losses(tmp_path, 2, tp2, "tp2"), ref, 1e-4)
    _close(_losses(tmp_path, 2, _resume_from(_cfg(tmp_path, "dp2", data, True, 2), src), "dp2"), ref, 1e-4)

    iter_dir = os.path.join(src["run_dir"], "checkpoints", f"iter_{ITERS:07d}")
    assert ckpt_verify.problems(iter_dir, "model_optim_rng.pt") == []
    path = os.path.join(iter_dir, "mp_rank_00_001", "distrib_optim.pt")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    assert any("distrib_optim.pt" in p for p in ckpt_verify.problems(iter_dir, "model_optim_rng.pt"))


def test_a_missing_distrib_optim_file_is_named():
    import pytest

    from trainer.checkpoint.files import CheckpointError
    from trainer.restore.distrib_optim import load_optimizer

    saved = {"optimizer": {"state": {}, "param_groups": [], "distributed": True, "file": "distrib_optim.pt"}}
    with pytest.raises(CheckpointError, match="distrib_optim.pt is missing.*checkpoint.load=model-only"):
        load_optimizer(None, saved, [], None, None, {})


def test_a_foreign_distrib_optim_file_is_refused(tmp_path):
    """Megatron-LM's own distrib_optim.pt (per-bucket buffers; none of its fixtures has one) is not
    misread as Slipway's: the error says to start from the weights."""
    import pytest

    from trainer.checkpoint.files import CheckpointError
    from trainer.restore.distrib_optim import read_beside

    torch.save({"per_bucket_numel": [[10]], "0": {"param": torch.zeros(10)}}, tmp_path / "distrib_optim.pt")
    assert read_beside(str(tmp_path / "elsewhere" / "model_optim_rng.pt")) is None
    with pytest.raises(CheckpointError, match="not Slipway's distributed-optimizer state.*model-only"):
        read_beside(str(tmp_path / "model_optim_rng.pt"))


def test_distributed_optimizer_with_the_interleaved_schedule(tmp_path):
    """(tp, pp, dp) = (1, 2, 2) with virtual_pp_size=2: the option's losses equal the plain optimizer's
    (1e-6), its checkpoint (``model0``/``model1`` and a ``distrib_optim.pt`` keyed by global names)
    resumes bit-exactly, and continues without interleaving and without the option (reshard path)."""
    data = write_dataset(str(tmp_path / "data"))
    interleaved = {"tp_size": 1, "pp_size": 2, "virtual_pp_size": 2}

    def cfg(name: str, distributed: bool, parallel: dict) -> dict:
        d = _cfg(tmp_path, name, data, distributed, 2)
        d["model"]["num_layers"], d["parallel"] = 4, parallel
        return d

    src = cfg("v2", True, interleaved)
    ref = _losses(tmp_path, 4, src, "v2")
    _close(_losses(tmp_path, 4, cfg("v2plain", False, interleaved), "v2plain"), ref, 1e-6)
    distrib = load_file(os.path.join(os.path.dirname(shard_path(os.path.join(src["run_dir"], "checkpoints"),
                                                                SAVE_AT, 0, 1, 2)), "distrib_optim.pt"))
    assert "encoder.layers.3.mlp.dense_h_to_4h.weight" in distrib["state"]  # global: chunk 1 of stage 1
    exact = _losses(tmp_path, 4, _resume_from(cfg("v2b", True, interleaved), src), "v2b")
    assert exact == {k: ref[k] for k in exact} and sorted(map(int, exact)) == [5, 6, 7, 8]
    plain = _resume_from(cfg("v1", False, {"tp_size": 1, "pp_size": 2}), src)
    _close(_losses(tmp_path, 4, plain, "v1"), ref, 1e-4)
