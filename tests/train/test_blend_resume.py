"""Exact resume mid-blend through the whole trainer: a run on ``data.paths=[0.3,A,0.7,B]`` stopped at
iteration 20 (signal, checkpoint) and resumed reproduces the unbroken run's every loss bit for bit, which it
can only do when the restart reads the same blended sample sequence from ``consumed_train_samples`` on."""

from tests.train.harness import run_cfg, tiny_config, write_dataset
from tests.train.test_resume import STOP_AT, _check, _keys, _stop_rank0_at


def test_exact_resume_mid_blend(tmp_path):
    a = write_dataset(str(tmp_path / "a"), n_docs=120, seed=1)
    b = write_dataset(str(tmp_path / "b"), n_docs=60, seed=2)
    data = {"paths": ["0.3", a, "0.7", b], "cache_dir": str(tmp_path / "index-cache")}
    straight = run_cfg(tiny_config(str(tmp_path / "straight"), a, data=data))
    stopped = tiny_config(str(tmp_path / "stopped"), a, data=data)
    first = run_cfg(stopped, _stop_rank0_at(0, STOP_AT))
    second = run_cfg(stopped)
    _check({"a": _keys(straight.losses), "a_eval": straight.eval_losses, "b": _keys(first.losses),
            "b_eval": first.eval_losses, "b_code": first.exit_code, "b_iter": first.iteration},
           {"c": _keys(second.losses), "c_eval": second.eval_losses, "c_code": second.exit_code})
    blends = list((tmp_path / "index-cache").glob("*-blend-train-description.json"))
    assert len(blends) == 1  # the run trained on the blend (and the restart reused its indices)
