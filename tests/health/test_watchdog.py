"""Heartbeats and the watchdog on real training runs (one rank per process): a stalled step ends the
process with exit 70 and a line naming the iteration; slow start-up, checkpoint saves and evaluation do
not; heartbeats are throttled and atomic; status's judgement of them (stale, stalled, hung, exited)."""

import json
import os
import re
import threading
import time

import pytest
import torch.multiprocessing as mp

from tests.health.helpers import VirtualClock, launch
from tests.train.harness import run_cfg, tiny_config, write_dataset
from tests.waits import NEVER_S
from trainer.checkpoint import protocol as ckpt
from trainer.health import (
    HealthConfig,
    Monitor,
    heartbeat_path,
    judge,
    read_heartbeats,
    stopped_ranks,
    summarize,
)
from trainer.run import RunHooks
from trainer.signals import EXIT_HANG

FAST = {"heartbeat_interval_s": 0.1, "hang_timeout_s": 3.0}  # seconds of the virtual progress clock


def _stalls_at_step(rank: int, d: dict, log_file: str) -> None:
    # This process's stderr (fd 2: log lines and the stack dump) into a file: the fork server that
    # started it holds whatever stderr pytest had when it was first used.
    os.dup2(os.open(log_file, os.O_WRONLY | os.O_CREAT, 0o644), 2)
    clock = VirtualClock().install()

    def on_step(it: int, loss: float) -> None:
        if it == 6:  # a step that never ends: its time passes, then it blocks until the watchdog acts
            clock.advance(d["train"]["hang_timeout_s"] + 0.5)
            threading.Event().wait(NEVER_S)

    run_cfg(d, RunHooks(on_step=on_step))


def test_stalled_step_ends_the_process(tmp_path):
    data = write_dataset(str(tmp_path / "data"))
    d = tiny_config(str(tmp_path / "run"), data, train={"iters": 20, **FAST})
    with pytest.raises(mp.ProcessExitedException) as e:
        launch(1, str(tmp_path), _stalls_at_step, d, str(tmp_path / "stderr.txt"))
    assert e.value.exit_code == EXIT_HANG
    err = (tmp_path / "stderr.txt").read_text()
    m = re.search(r"watchdog: no training progress for (\d+\.\d) s \(train.hang_timeout_s=3\) at iteration "
                  r"6, phase train; stopped progressing: rank 0 of 1 \(host \S+, pid \d+\) itself\.", err)
    assert m and float(m.group(1)) == 3.5, err
    assert "in on_step" in err  # the stacks follow: the stuck thread's shows where it is
    beat = json.loads(open(heartbeat_path(str(tmp_path / "run"), 0)).read())
    assert beat["phase"] == "hung" and beat["iteration"] == 6 and "exit code 70" in beat["message"]


def _slow_phases(rank: int, d: dict, out: str) -> None:
    """Start-up takes longer than hang_timeout_s (3 s of the virtual clock), and so does every evaluation
    (of 2 batches) and every save with the step before it; each save and evaluation batch alone fits."""
    clock = VirtualClock().install()
    real_save = ckpt.save_checkpoint

    def slow_save(*args, **kwargs):
        clock.advance(2.0)
        return real_save(*args, **kwargs)

    import trainer.run.loop as training

    real_eval = training.eval_step

    def slow_eval(*args, **kwargs):
        clock.advance(2.0)
        return real_eval(*args, **kwargs)

    def slow_step(it: int, loss: float) -> None:
        clock.advance(1.5)  # the step before a save: with the save's 2 s, longer than the timeout

    ckpt.save_checkpoint, training.eval_step = slow_save, slow_eval
    r = run_cfg(d, RunHooks(on_build=lambda model: clock.advance(4.0), on_step=slow_step))
    with open(out, "w") as f:
        json.dump({"code": r.exit_code, "iteration": r.iteration}, f)


def test_slow_startup_saves_and_evaluation_are_not_hangs(tmp_path):
    data = write_dataset(str(tmp_path / "data"))
    d = tiny_config(str(tmp_path / "run"), data, train={"iters": 8, "save_interval": 4, "eval_interval": 4,
                                                       "eval_iters": 2, **FAST})
    launch(1, str(tmp_path), _slow_phases, d, str(tmp_path / "out.json"))
    assert json.loads((tmp_path / "out.json").read_text()) == {"code": 0, "iteration": 8}
    assert ckpt.read_tracker(str(tmp_path / "run" / "checkpoints")) == 8
    [rank0] = read_heartbeats(str(tmp_path / "run"))
    assert (rank0.state, rank0.iteration, rank0.host) == ("exited", 8, os.uname().nodename)


class _Counting(Monitor):
    writes = 0

    def write(self, **extra):
        type(self).writes += 1
        super().write(**extra)


def test_heartbeats_throttled_and_atomic(tmp_path):
    """Hundreds of thousands of ticks in a second: about one write per interval; never a torn file."""
    torn = []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            try:
                json.loads(open(heartbeat_path(str(tmp_path), 0)).read())
            except FileNotFoundError:
                pass
            except ValueError as e:
                torn.append(e)

    t = threading.Thread(target=reader)
    t.start()
    interval = 0.2
    with _Counting(HealthConfig(heartbeat_interval_s=interval, hang_timeout_s=0), str(tmp_path)) as m:
        started = time.monotonic()
        m.begin()
        i, deadline = 0, started + NEVER_S
        while _Counting.writes < 6 and time.monotonic() < deadline:  # begin + 5 periodic writes
            i += 1
            m.tick(i)
        elapsed = time.monotonic() - started
        writes = _Counting.writes
        beat = json.loads(open(heartbeat_path(str(tmp_path), 0)).read())
    stop.set()
    t.join()
    assert not torn
    assert writes == 6, writes
    # Paced by time, not by ticks: never more than one write per interval (plus begin's), however many
    # ticks came, and however slowly this machine ran them.
    assert writes <= elapsed / interval + 1 and i > 100 * writes, (writes, elapsed, i)
    assert beat["iteration"] > 100 and beat["phase"] == "startup"
    final = json.loads(open(heartbeat_path(str(tmp_path), 0)).read())
    assert final["phase"] == "exited" and final["iteration"] == i
    assert not [n for n in os.listdir(tmp_path / "heartbeats") if ".tmp" in n]


def test_failure_recorded_and_extra_ranks_removed(tmp_path):
    os.makedirs(tmp_path / "heartbeats")
    (tmp_path / "heartbeats" / "rank_00005.json").write_text("{}")  # from an earlier 8-rank attempt
    with pytest.raises(RuntimeError):
        with Monitor(HealthConfig(), str(tmp_path)) as m:
            m.begin()
            raise RuntimeError("data file vanished")
    assert os.listdir(tmp_path / "heartbeats") == ["rank_00000.json"]
    [h] = read_heartbeats(str(tmp_path))
    assert h.state == "failed" and h.message == "RuntimeError: data file vanished"


def test_judgement():
    now = 1000.0
    beat = {"rank": 3, "host": "n2", "pid": 7, "iteration": 40, "phase": "train", "interval_s": 10.0}
    ok = judge({**beat, "time": now - 5, "progress_time": now - 6}, now)
    stale = judge({**beat, "time": now - 51, "progress_time": now - 51}, now)  # default: 5 intervals
    stalled = judge({**beat, "time": now - 1, "progress_time": now - 400}, now)
    assert (ok.state, stale.state, stalled.state) == ("ok", "stale", "stalled")
    assert judge({**beat, "time": now - 5, "progress_time": now - 5}, now, stale_after_s=2).state == "stale"
    assert judge({**beat, "time": now - 999, "phase": "exited"}, now).state == "exited"
    starting = judge({**beat, "time": now - 1, "progress_time": now - 999, "phase": "startup"}, now)
    assert starting.state == "ok"  # an index build is not a stall
    assert summarize([ok, ok]) == "ok 2/2"
    assert summarize([ok, stale, stalled]) == "stale: rank 3@n2 (51 s); stalled: rank 3@n2 (400 s)"


def test_the_watchdog_blames_the_ranks_the_others_wait_for():
    """Stale, failed or missing heartbeats first; else the ranks behind; never the reporter for merely
    waiting; nobody when every rank looks the same."""
    now = 1000.0

    def beat(rank, host, age, it):
        return judge({"rank": rank, "host": host, "pid": rank + 10, "iteration": it, "phase": "train",
                      "interval_s": 1.0, "time": now - age, "progress_time": now - 9}, now, stale_after_s=3)

    waiting = [beat(0, "n1", 0.5, 12), beat(1, "n1", 0.5, 12)]
    assert [r.rank for r in stopped_ranks([*waiting, beat(3, "n2", 9, 12)], 4, 0)] == [2, 3]  # 2: no file
    assert stopped_ranks([*waiting, beat(3, "n2", 9, 12)], 4, 0)[1].host == "n2"
    assert [r.rank for r in stopped_ranks([*waiting, beat(2, "n2", 0.5, 11)], 3, 0)] == [2]  # behind
    assert stopped_ranks(waiting, 2, 0) == []
    # A rank that was stopped (SIGSTOP) and continued: its own heartbeat is behind, yet it waited for no one
    # of them; the ranks its peers' watchdogs ended are gone from the collective.
    assert stopped_ranks([*waiting, beat(2, "n2", 0.5, 11)], 3, 2) == []
    hung = judge({"rank": 1, "host": "n1", "pid": 11, "iteration": 12, "phase": "hung", "interval_s": 1.0,
                  "time": now - 0.5, "progress_time": now - 9}, now, stale_after_s=3)
    assert [r.rank for r in stopped_ranks([waiting[0], hung, beat(2, "n2", 0.5, 11)], 3, 2)] == [1]


def test_settable_from_launch_overrides():
    """``train.hang_timeout_s=...`` on the launch.py command line reaches the trainer's config."""
    from orchestrator.planning.plan import PlanInputs, make_plan
    from tests.orchestrator.conftest import compose_cfg
    from trainer.config import RunConfig

    cfg = compose_cfg(["+experiment=codeparrot_smoke", "train.hang_timeout_s=90", "train.preflight=false",
                       "train.heartbeat_interval_s=2", "train.preflight_slow_factor=8"])
    plan = make_plan(cfg, PlanInputs("r", "/runs/r"), exists=lambda p: True)
    health = RunConfig.from_dict(plan.stage("train").job.trainer_config).train.health()
    assert health == HealthConfig(heartbeat_interval_s=2, hang_timeout_s=90, preflight=False,
                                  preflight_slow_factor=8)
    defaults = RunConfig.from_dict(make_plan(compose_cfg(["+experiment=codeparrot"]), PlanInputs(
        "r", "/runs/r"), exists=lambda p: True).stage("train").job.trainer_config).train.health()
    assert defaults == HealthConfig(heartbeat_interval_s=10, hang_timeout_s=1800, preflight=True)
    with pytest.raises(ValueError, match=r"train.hang_timeout_s=-5: must be seconds >= 0"):
        HealthConfig(hang_timeout_s=-5)
