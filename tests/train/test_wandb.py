"""W&B offline: the logged metrics (read back from the run files) equal the log lines; a crashed and
resumed run continues the same W&B run without logging a step twice; only rank 0 logs; online mode
without a key fails before training; the key is never written."""

import logging
import os
import re

import pytest

from tests.logs import LogLines
from tests.train import wandb_reader
from tests.train.harness import run_cfg, spawn, tiny_config, write_dataset
from trainer.run import RunHooks
from trainer.signals import EXIT_OK, EXIT_REQUEUE

SECRET = "slipway-test-secret-0123456789abcdef0123456789"
LINE = re.compile(r"iteration\s+(\d+)/")


def _field(line: str, name: str) -> str | None:
    m = re.search(re.escape(name) + r": ([^|]+) \|", line)
    return m.group(1).strip() if m else None


def _crash_at(iteration: int) -> RunHooks:
    def on_step(it: int, loss: float) -> None:
        if it == iteration:
            raise RuntimeError("simulated crash")

    return RunHooks(on_step=on_step)


def test_offline_metrics_match_log_lines_and_resume_never_duplicates(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    data = write_dataset(str(tmp_path / "data"))
    d = tiny_config(str(tmp_path / "run"), data, run_id="slipway-run-1",
                    train={"iters": 30, "save_interval": 10, "eval_interval": 10},
                    logging={"wandb": {"mode": "offline", "project": "p", "group": "g", "name": "n",
                                       "tags": ["a", "b"]}})
    capture = LogLines()
    logging.getLogger("slipway.trainer.run.loop").addHandler(capture)
    try:
        with pytest.raises(RuntimeError, match="simulated crash"):  # after logging 25, last checkpoint 20
            run_cfg(d, _crash_at(27))
        wandb.finish(exit_code=1)  # what W&B's atexit hook does when a Python process dies of an error
        first_lines = list(capture.lines)
        r = run_cfg(d)  # restart: resumes from iteration 20, replays 21..27 identically
    finally:
        logging.getLogger("slipway.trainer.run.loop").removeHandler(capture)
    wandb.teardown()  # wait until W&B's service has written everything (as at process exit)
    assert r.exit_code == EXIT_OK and r.wandb_run_id == "slipway-run-1"

    files = wandb_reader.run_files(str(tmp_path / "run"))
    assert len(files) == 2 and all(wandb_reader.run_ids(f) == {"slipway-run-1"} for f in files)
    rows = [row for f in files for row in wandb_reader.history(f)]
    steps = [row["_step"] for row in rows if "train/lm_loss" in row]
    assert steps == [5, 10, 15, 20, 25, 30]  # 25 logged once although iterations 21..27 ran twice
    assert [row["_step"] for row in wandb_reader.history(files[1])] == [30]  # the restart logged only 30
    logged = {row["_step"]: row for row in rows if "train/lm_loss" in row}
    # The line printed when W&B logged the step: the first run's up to its crash, then the restart's.
    lines: dict[int, str] = {}
    for x in first_lines + capture.lines[len(first_lines):]:
        if LINE.search(x):
            lines.setdefault(int(LINE.search(x).group(1)), x)
    for step, row in logged.items():
        line = lines[step]
        assert float(_field(line, "lm loss")) == pytest.approx(row["train/lm_loss"], rel=1e-6)
        assert float(_field(line, "learning rate")) == pytest.approx(row["train/lr"], rel=1e-3)
        assert float(_field(line, "grad norm")) == pytest.approx(row["train/grad_norm"], abs=6e-4)
        assert float(_field(line, "loss scale")) == row["train/loss_scale"] == 1.0
        assert int(_field(line, "consumed samples")) == row["train/consumed_samples"] == step * 4
        assert int(_field(line, "number of skipped iterations")) == row["train/skipped_iters"] == 0
        assert float(_field(line, "tokens per second")) == pytest.approx(row["perf/tokens_per_s"], abs=0.06)
    evals = [row["_step"] for row in rows if "valid/lm_loss" in row]
    assert evals == [10, 20, 30]
    config = _config(files[0])
    assert config["model"]["hidden_size"] == 32 and config["train"]["iters"] == 30
    for root, _, names in os.walk(tmp_path / "run"):  # the key is never written anywhere
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                assert SECRET.encode() not in f.read(), os.path.join(root, name)


def _config(path: str) -> dict:
    import json

    out = {}
    for rec in wandb_reader.read_records(path):
        if rec.WhichOneof("record_type") == "config":
            for item in rec.config.update:
                out[item.key] = json.loads(item.value_json)
        if rec.WhichOneof("record_type") == "run":
            for item in rec.run.config.update:
                out[item.key] = json.loads(item.value_json)
    return {k: v.get("value", v) if isinstance(v, dict) else v for k, v in out.items()}


def _dp2(rank: int, d: dict) -> None:
    run_cfg(d)


def test_only_rank0_logs(tmp_path):
    data = write_dataset(str(tmp_path / "data"))
    d = tiny_config(str(tmp_path / "run"), data, train={"iters": 4, "log_interval": 2},
                    logging={"wandb": {"mode": "offline"}})
    spawn(2, str(tmp_path), _dp2, d)
    files = wandb_reader.run_files(str(tmp_path / "run"))
    assert len(files) == 1
    assert [row["_step"] for row in wandb_reader.history(files[0])] == [2, 4]


def test_online_without_key_fails_fast(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    d = tiny_config(str(tmp_path / "run"), str(tmp_path / "nodata"), logging={"wandb": {"mode": "online"}})
    with pytest.raises(RuntimeError, match="WANDB_API_KEY"):
        run_cfg(d)
    assert not os.path.exists(tmp_path / "run")  # nothing started


def test_a_wandb_error_never_turns_a_clean_stop_into_a_failure(tmp_path, monkeypatch):
    """scancel → SIGTERM → checkpoint → exit 75, even when W&B's finish (and a log call) raise, as they do
    when the W&B service process is gone (ConnectionResetError)."""
    import signal

    import wandb

    def broken(*args, **kwargs):
        raise ConnectionResetError("[Errno 104] Connection reset by peer")

    data = write_dataset(str(tmp_path / "data"))
    d = tiny_config(str(tmp_path / "run"), data, train={"iters": 30, "save_interval": 10, "log_interval": 1},
                    logging={"wandb": {"mode": "offline", "project": "p"}})

    def on_step(it: int, loss: float) -> None:
        if it == 6:
            monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", broken)
            monkeypatch.setattr(wandb.sdk.wandb_run.Run, "finish", broken)
        if it == 8:
            os.kill(os.getpid(), signal.SIGTERM)

    capture = LogLines()
    logging.getLogger("slipway.trainer.run.metrics").addHandler(capture)
    try:
        r = run_cfg(d, RunHooks(on_step=on_step))
    finally:
        logging.getLogger("slipway.trainer.run.metrics").removeHandler(capture)
        monkeypatch.undo()
    assert r.exit_code == EXIT_REQUEUE and r.iteration == 8
    assert any("finishing the run failed (ConnectionResetError" in x for x in capture.lines), capture.lines
    assert any("logging step" in x and "training continues" in x for x in capture.lines), capture.lines


def test_a_relaunch_from_an_earlier_checkpoint_says_what_wandb_keeps(tmp_path):
    """A run logged to 12, then resumed from its checkpoint at 4 with another learning rate (checkpoint.load=
    4): the metrics file holds the new values of 5..12. An offline W&B run cannot be rewound, so the job
    says which steps keep the earlier values and where the new ones are; W&B's history has no step twice."""
    import json

    import wandb

    data = write_dataset(str(tmp_path / "data"))
    run = tmp_path / "run"
    base = dict(train={"iters": 12, "save_interval": 4, "log_interval": 2},
                logging={"wandb": {"mode": "offline", "project": "p"}})
    run_cfg(tiny_config(str(run), data, run_id="w1", checkpoint={"keep": None}, **base))
    capture = LogLines()
    logging.getLogger("slipway.trainer.run.metrics").addHandler(capture)
    try:
        r = run_cfg(tiny_config(str(run), data, run_id="w1", checkpoint={"keep": None, "load": 4},
                                optim={"lr": 3e-3}, **base))
    finally:
        logging.getLogger("slipway.trainer.run.metrics").removeHandler(capture)
    wandb.teardown()
    assert r.exit_code == EXIT_OK
    said = [x for x in capture.lines if "already holds steps" in x]
    assert len(said) == 1 and "steps 5..12, logged by an earlier job" in said[0], capture.lines
    assert "an offline run cannot be rewound" in said[0] and "train_metrics.jsonl" in said[0], said
    rows = [json.loads(x) for x in (run / "train_metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows if "train/lm_loss" in row] == [2, 4, 6, 8, 10, 12]
    files = wandb_reader.run_files(str(run))
    steps = [row["_step"] for f in files for row in wandb_reader.history(f) if "train/lm_loss" in row]
    assert steps == [2, 4, 6, 8, 10, 12]


def test_online_resumes_behind_the_logged_step_by_rewinding_in_wandbs_own_spelling(tmp_path):
    """Online, the run is rewound to the job's checkpoint (wandb.init(resume_from=...)): the argument is
    parsed by the installed wandb's own Settings into the run, the metric and the step."""
    import wandb

    from trainer.run.metrics import _resume, can_rewind

    assert can_rewind()  # wandb >= 0.17.1 (the project's floor is higher)
    how, skip_to = _resume("abc123", last=25, start=20, mode="online", run_dir=str(tmp_path))
    assert skip_to == 20 and set(how) == {"resume_from"}  # wandb refuses resume= together with it
    moment = wandb.Settings(resume_from=how["resume_from"]).resume_from
    assert (moment.run, moment.metric, moment.value) == ("abc123", "_step", 20)
    assert _resume("abc123", last=25, start=25, mode="online", run_dir=str(tmp_path)) == (
        {"id": "abc123", "resume": "allow"}, 25)
