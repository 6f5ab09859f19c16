"""checkpoint.format=torch_dist, Slipway's side (Megatron-core loading it: tests/mcore/test_model.py).

A tp 2 run stopped and resumed from its own torch_dist checkpoint continues bit for bit (weights, Adam
state, schedule, data position, every rank's RNG: test_resume's check), the folder holds Megatron's files
plus a manifest that verifies, and the same checkpoint resumes at tp 1 with each parameter's Adam moments
re-sliced from the stored global tensors. A SIGKILL in the middle of a torch_dist save leaves the previous
checkpoint committed, and the restart continues bit for bit and cleans up (test_faults' check).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.train.harness import load_json, spawn, tiny_config, write_dataset
from tests.train.test_faults import _resume, _run_with_failpoint, reference  # noqa: F401 (a fixture)
from tests.train.test_resume import STOP_AT, _check, _resumed, _straight_and_stopped
from trainer.checkpoint import protocol as ckpt
from trainer.checkpoint import verify as ckpt_verify
from trainer.checkpoint.files import DIST_CONFIG
from trainer.config import RunConfig
from trainer.convert import dist as dist_ckpt
from trainer.convert import names
from trainer.parallel import ParallelState
from trainer.run.entry import build_components, load_checkpoint, resolve_load
from trainer.signals import EXIT_OK

# The distributed optimizer writes its fp32 masters too (optimizer.state.fp32_param.*); the resume at tp 1
# loads them into a plain optimizer. The plain optimizer's save is the SIGKILL test's.
TP2 = {"parallel": {"tp_size": 2, "pp_size": 1}, "train": {"micro_batch_size": 1, "global_batch_size": 2},
       "optim": {"distributed": True}, "checkpoint": {"format": "torch_dist"}}


def _stored(iter_dir) -> dict[str, torch.Tensor]:
    """Every tensor of the folder by its torch_dist key, read by torch alone."""
    return dist_ckpt.read_tensors(iter_dir, keep=lambda key: True)


def _resume_at_tp1(tmp_path, stopped: dict, iter_dir) -> None:
    """Full resume (not model-only) at tp 1 with a plain optimizer, in this process: the weights and Adam
    moments of every parameter are the stored global ones (the run never had tp 1; vocabulary rows beyond
    the model's are padding)."""
    one = tiny_config(str(tmp_path / "one"), stopped["data"]["paths"][0], parallel={"tp_size": 1},
                      checkpoint={"load_dir": stopped["checkpoint"]["dir"]})
    cfg = RunConfig.from_dict(one)
    b = build_components(cfg, ParallelState.single())
    state = load_checkpoint(resolve_load(cfg.checkpoint), b.gpt, b.model, b.parts)
    assert state.iteration == STOP_AT
    stored = _stored(iter_dir)
    for name, p in b.model.named_parameters():
        key, layer = names.to_dist(names.to_mcore("language_model." + name))
        for moment in ("exp_avg", "exp_avg_sq"):
            full = stored[f"optimizer.state.{moment}.{key}"]
            want = (full if layer is None else full[layer])[:p.shape[0]]
            got = b.parts.optimizer.state[p][moment]
            assert torch.equal(got, want), (name, moment)
        assert torch.equal(p.detach(), (stored[key] if layer is None else stored[key][layer])[:p.shape[0]])


def test_torch_dist_resumes_exactly_and_at_another_layout(tmp_path):
    data = write_dataset(str(tmp_path / "data"))
    straight = tiny_config(str(tmp_path / "straight"), data, **TP2)
    stopped = tiny_config(str(tmp_path / "stopped"), data, **TP2)
    stopped["checkpoint"]["dir"] = str(tmp_path / "stopped" / "checkpoints")
    spawn(2, str(tmp_path), _straight_and_stopped, straight, stopped, str(tmp_path / "first"))
    iter_dir = tmp_path / "stopped" / "checkpoints" / f"iter_{STOP_AT:07d}"
    files = sorted(os.listdir(iter_dir))
    assert [f for f in files if not f.startswith(ckpt_verify.DIGEST_FILE)] == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt", ckpt_verify.MANIFEST, "metadata.json"]
    assert json.loads((iter_dir / "metadata.json").read_text()) == DIST_CONFIG
    assert ckpt_verify.problems(str(iter_dir), ckpt_verify.SHARD_FILE) == []
    stored = _stored(iter_dir)
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in stored
    assert "optimizer.state.fp32_param.decoder.layers.self_attention.linear_qkv.weight" in stored
    _resume_at_tp1(tmp_path, stopped, iter_dir)
    spawn(2, str(tmp_path), _resumed, stopped, str(tmp_path / "second"))
    for rank in range(2):
        _check(load_json(f"{tmp_path}/first.{rank}"), load_json(f"{tmp_path}/second.{rank}"))


# The two states a killed torch_dist save can leave: its files in the shared .tmp-iter_N folder (killed
# before the rename), or a renamed iter_N that the tracker does not name (killed before the commit).
@pytest.mark.parametrize("failpoint", ["mid_write", "after_rename"])
def test_sigkill_during_a_torch_dist_save_keeps_the_previous_checkpoint(tmp_path, reference, failpoint):  # noqa: F811
    data, straight = reference
    d = tiny_config(str(tmp_path / "run"), data, train={"iters": 20, "save_interval": 5},
                    checkpoint={"format": "torch_dist"})
    with pytest.raises(mp.ProcessExitedException) as e:  # SIGKILLed at the failpoint of the save at 10
        spawn(1, str(tmp_path), _run_with_failpoint, d, f"{failpoint}@10")
    assert e.value.signal_name == "SIGKILL"
    ckpt_dir = str(tmp_path / "run" / "checkpoints")
    assert ckpt.read_tracker(ckpt_dir) == 5
    spawn(1, str(tmp_path), _resume, d, str(tmp_path / "resumed.json"))
    resumed = load_json(str(tmp_path / "resumed.json"))
    assert resumed["code"] == EXIT_OK
    assert {int(i): loss for i, loss in resumed["losses"].items()} == {i: straight[i] for i in range(6, 21)}
    assert sorted(os.listdir(ckpt_dir)) == ["iter_0000015", "iter_0000020", ckpt.TRACKER]  # no leftovers
