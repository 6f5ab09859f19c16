"""Exact resume: 40 iterations straight == 20, graceful stop (signal), resume, 20 more — bit for bit.

Deterministic mode, dropout on, CPU/gloo, for (tp, pp, dp) = (1,1,1), (2,2,1), (1,1,2). The stop signal is
delivered to rank 0 only, so the ranks' all-reduced agreement is exercised too; the resume runs in fresh
processes, so everything (data position, LR, Adam, RNG of every rank, tracker) must come from the files.
"""

import json
import os
import signal

import pytest

from tests.train.harness import load_json, run_cfg, save_json, spawn, tiny_config, write_dataset
from trainer.checkpoint import verify as ckpt_verify
from trainer.signals import EXIT_OK, EXIT_REQUEUE

STOP_AT = 20


def _stop_rank0_at(rank: int, iteration: int):
    from trainer.run import RunHooks

    def on_step(it: int, loss: float) -> None:
        if rank == 0 and it == iteration:
            os.kill(os.getpid(), signal.SIGUSR2)

    return RunHooks(on_step=on_step)


def _straight_and_stopped(rank: int, straight: dict, stopped: dict, out: str) -> None:
    a = run_cfg(straight)
    b = run_cfg(stopped, _stop_rank0_at(rank, STOP_AT))
    save_json(f"{out}.{rank}", {"a": a.losses, "a_eval": a.eval_losses, "b": b.losses,
                                "b_eval": b.eval_losses, "b_code": b.exit_code, "b_iter": b.iteration})


def _resumed(rank: int, stopped: dict, out: str) -> None:
    c = run_cfg(stopped)
    save_json(f"{out}.{rank}", {"c": c.losses, "c_eval": c.eval_losses, "c_code": c.exit_code})


def _check(first: dict, second: dict) -> None:
    assert first["b_code"] == EXIT_REQUEUE and first["b_iter"] == STOP_AT
    assert second["c_code"] == EXIT_OK
    straight = first["a"]
    assert sorted(map(int, straight)) == list(range(1, 41))
    resumed = {**first["b"], **second["c"]}
    assert sorted(map(int, first["b"])) == list(range(1, STOP_AT + 1))
    assert sorted(map(int, second["c"])) == list(range(STOP_AT + 1, 41))
    mismatches = [(k, straight[k], resumed[k]) for k in straight if straight[k] != resumed[k]]
    assert not mismatches, mismatches[:5]  # bitwise: float equality of every iteration's loss
    assert first["a_eval"] == {**first["b_eval"], **second["c_eval"]}
    assert straight["40"] < straight["1"]  # it trained


@pytest.mark.parametrize("tp,pp,dp", [(2, 2, 1), (1, 1, 2)])
def test_exact_resume_distributed(tmp_path, tp, pp, dp):
    data = write_dataset(str(tmp_path / "data"))
    world = tp * pp * dp
    sections = {"parallel": {"tp_size": tp, "pp_size": pp},
                "train": {"micro_batch_size": 1, "global_batch_size": 2 * dp}}
    straight = tiny_config(str(tmp_path / "straight"), data, **sections)
    stopped = tiny_config(str(tmp_path / "stopped"), data, **sections)
    spawn(world, str(tmp_path), _straight_and_stopped, straight, stopped, str(tmp_path / "first"))
    spawn(world, str(tmp_path), _resumed, stopped, str(tmp_path / "second"))
    for rank in range(world):  # every rank saw the same losses
        _check(load_json(f"{tmp_path}/first.{rank}"), load_json(f"{tmp_path}/second.{rank}"))
    iter_dir = tmp_path / "stopped" / "checkpoints" / "iter_0000040"
    shards = sorted(f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
                    for t in range(tp) for p in range(pp))
    assert sorted(os.listdir(iter_dir)) == sorted([*shards, ckpt_verify.MANIFEST])
    manifest = ckpt_verify.read_manifest(str(iter_dir))
    assert sorted(manifest["files"]) == [f"{s}/{ckpt_verify.SHARD_FILE}" for s in shards]
    assert (manifest["iteration"], manifest["tp_size"], manifest["pp_size"]) == (40, tp, pp)
    assert ckpt_verify.problems(str(iter_dir), ckpt_verify.SHARD_FILE) == []


def test_exact_resume_single_process(tmp_path):
    """(1,1,1) in this process; fresh-process resumes are covered by the distributed cases and by the
    CLI test (test_cli.py)."""
    data = write_dataset(str(tmp_path / "data"))
    a = run_cfg(tiny_config(str(tmp_path / "straight"), data))
    stopped = tiny_config(str(tmp_path / "stopped"), data)
    b = run_cfg(stopped, _stop_rank0_at(0, STOP_AT))
    c = run_cfg(stopped)
    _check({"a": _keys(a.losses), "a_eval": a.eval_losses, "b": _keys(b.losses), "b_eval": b.eval_losses,
            "b_code": b.exit_code, "b_iter": b.iteration},
           {"c": _keys(c.losses), "c_eval": c.eval_losses, "c_code": c.exit_code})


def _keys(losses: dict) -> dict:
    return {str(k): v for k, v in losses.items()}


def test_load_given_iteration_and_model_only(tmp_path):
    """checkpoint.load: an iteration of another run's checkpoints resumes exactly from it; model-only
    takes the weights and starts a fresh schedule at iteration 0."""
    import torch

    from trainer.checkpoint.protocol import load_file, shard_path

    data = write_dataset(str(tmp_path / "data"))
    src = tiny_config(str(tmp_path / "src"), data, train={"iters": 20, "save_interval": 5},
                      checkpoint={"keep": None})
    a = run_cfg(src)
    src_ckpt = str(tmp_path / "src" / "checkpoints")
    given = tiny_config(str(tmp_path / "given"), data, train={"iters": 20},
                        checkpoint={"load": 10, "load_dir": src_ckpt})
    g = run_cfg(given)
    assert sorted(g.losses) == list(range(11, 21)) and all(g.losses[i] == a.losses[i] for i in g.losses)
    fine = tiny_config(str(tmp_path / "fine"), data, train={"iters": 3},
                       checkpoint={"load": "model-only", "load_dir": src_ckpt})
    seen = {}
    f = run_cfg(fine, _record_weights(seen))
    assert sorted(f.losses) == [1, 2, 3]  # a fresh run: iteration 0, fresh optimizer and schedule
    saved = load_file(shard_path(src_ckpt, 20, 0, 0, 1))["model"]["language_model"]["encoder"]
    assert torch.equal(seen["w"], saved["layers.0.mlp.dense_h_to_4h.weight"])
    # A requeued fine-tuning run continues from its own checkpoints, not from load_dir again.
    f2 = run_cfg({**fine, "train": {**fine["train"], "iters": 5}})
    assert sorted(f2.losses) == [4, 5]


def _record_weights(seen: dict):
    from trainer.run import RunHooks

    def on_build(model) -> None:
        weight = dict(model.named_parameters())["encoder.layers.0.mlp.dense_h_to_4h.weight"]
        seen["w"] = weight.detach().clone()

    return RunHooks(on_build=on_build)


def test_a_resume_mid_log_interval_logs_what_the_uninterrupted_run_logs(tmp_path):
    """Stopped at iteration 6 with log_interval=4: the first window after the resume (7-8) continues the
    saved one (5-6), so the logged loss and skip counts at 8 equal the uninterrupted run's, bit for bit."""
    data = write_dataset(str(tmp_path / "data"))
    train = {"iters": 12, "log_interval": 4, "save_interval": 100}
    run_cfg(tiny_config(str(tmp_path / "straight"), data, train=train))
    stopped = tiny_config(str(tmp_path / "stopped"), data, train=train)
    assert run_cfg(stopped, _stop_rank0_at(0, 6)).exit_code == EXIT_REQUEUE
    assert run_cfg(stopped).exit_code == EXIT_OK

    def logged(run: str) -> dict[int, dict]:
        rows = [json.loads(x) for x in (tmp_path / run / "train_metrics.jsonl").read_text().splitlines()]
        keep = ("train/lm_loss", "train/skipped_iters", "train/nan_iters")
        return {r["iteration"]: {k: r.get(k) for k in keep} for r in rows if "train/lm_loss" in r}

    assert logged("stopped") == logged("straight") and sorted(logged("straight")) == [4, 8, 12]
