"""What a cluster does to a run: SIGKILL in the middle of a checkpoint save, signals during a save,
fp16 overflow, NaN in fp32 — and that the run, or its restart, comes out right."""

import itertools
import json
import math
import os
import signal
import sys
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp

from tests.seam import hook_env
from tests.train.harness import load_json, run_cfg, save_json, spawn, tiny_config, write_dataset
from tests.waits import NEVER_S
from trainer import faults
from trainer.checkpoint import protocol as ckpt
from trainer.run import RunHooks
from trainer.signals import EXIT_NONFINITE, EXIT_OK, EXIT_REQUEUE

STORM = (signal.SIGTERM, signal.SIGUSR2)
FAILPOINTS = ["before_write", "mid_write", "before_rename", "after_rename", "before_tracker", "after_tracker"]


def _run_with_failpoint(rank: int, d: dict, failpoint: str) -> None:
    os.environ.update(hook_env(CKPT_FAILPOINT=failpoint))
    run_cfg(d)


def _resume(rank: int, d: dict, out: str) -> None:
    r = run_cfg(d)
    save_json(out, {"code": r.exit_code, "losses": r.losses})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 20-iteration run's losses (one thread, like every other run here)."""
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("ref")
    data = write_dataset(str(tmp / "data"))
    r = run_cfg(tiny_config(str(tmp / "run"), data, train={"iters": 20, "save_interval": 5}))
    return data, r.losses


# checkpoint.async_save (the default: the failpoints fire in the background writer thread while the
# training thread goes on) and the synchronous save; torch_dist in the background at the points its own
# protocol passes (DCP writes the data files, then digests, the rename and the tracker).
SAVE_MODES = {"async": {}, "sync": {"async_save": False}, "torch_dist": {"format": "torch_dist"}}
DIST_FAILPOINTS = ["before_write", "mid_write", "before_rename", "before_tracker", "after_tracker"]
CASES = [(m, f) for m in ("async", "sync") for f in FAILPOINTS] + [("torch_dist", f) for f in DIST_FAILPOINTS]


@pytest.mark.parametrize("mode,failpoint", CASES)
def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path, reference, mode, failpoint):
    data, straight = reference
    d = tiny_config(str(tmp_path / "run"), data, train={"iters": 20, "save_interval": 5},
                    checkpoint={"keep": 2, **SAVE_MODES[mode]})
    with pytest.raises(mp.ProcessExitedException) as e:  # SIGKILLed at the failpoint of the save at 10
        spawn(1, str(tmp_path), _run_with_failpoint, d, f"{failpoint}@10")
    assert e.value.signal_name == "SIGKILL"
    ckpt_dir = str(tmp_path / "run" / "checkpoints")
    committed = ckpt.read_tracker(ckpt_dir)
    assert committed == (10 if failpoint == "after_tracker" else 5)
    if mode != "torch_dist":
        shard = ckpt.load_file(ckpt.shard_path(ckpt_dir, committed, 0, 0, 1))  # loadable, weights-only
        assert shard["iteration"] == committed and shard["args"].consumed_train_samples == committed * 4
    spawn(1, str(tmp_path), _resume, d, str(tmp_path / "resumed.json"))
    resumed = load_json(str(tmp_path / "resumed.json"))
    assert resumed["code"] == EXIT_OK
    assert sorted(map(int, resumed["losses"])) == list(range(committed + 1, 21))
    # Bit for bit the uninterrupted run's losses, resumed from a checkpoint the background writer wrote.
    assert all(resumed["losses"][str(i)] == straight[i] for i in range(committed + 1, 21))
    leftovers = [n for _, dirs, files in os.walk(ckpt_dir) for n in dirs + files
                 if ".tmp-" in n or ".trash-" in n]
    assert not leftovers  # the next successful save cleaned up after the killed one
    assert sorted(os.listdir(ckpt_dir)) == ["iter_0000015", "iter_0000020", ckpt.TRACKER]  # keep=2


@pytest.mark.parametrize("mode,failpoint", [("async", "mid_write"), ("sync", "before_rename"),
                                            ("torch_dist", "mid_write")])
def test_a_run_killed_inside_its_first_save_starts_over(tmp_path, reference, mode, failpoint):
    """No checkpoint was ever committed: the retry trains from the start (it used to refuse, taking the
    unfinished folder for a damaged checkpoint; seen in CI, the goodput bench's async run)."""
    data, straight = reference
    d = tiny_config(str(tmp_path / "run"), data, train={"iters": 20, "save_interval": 5},
                    checkpoint=dict(SAVE_MODES[mode]))
    with pytest.raises(mp.ProcessExitedException):  # SIGKILLed inside the save at 5
        spawn(1, str(tmp_path), _run_with_failpoint, d, f"{failpoint}@5")
    assert ckpt.read_tracker(str(tmp_path / "run" / "checkpoints")) is None
    spawn(1, str(tmp_path), _resume, d, str(tmp_path / "resumed.json"))
    resumed = load_json(str(tmp_path / "resumed.json"))
    assert resumed["code"] == EXIT_OK and sorted(map(int, resumed["losses"])) == list(range(1, 21))
    assert all(resumed["losses"][str(i)] == straight[i] for i in range(1, 21))


def _signal_storm(rank: int, d: dict, out: str) -> None:
    """From iteration 10 on, SIGTERM and SIGUSR2 arrive in turn every millisecond. The save at 10 holds in
    the middle of writing its shard (file written, not yet fsynced or renamed) until several of each kind
    arrived there, so the handlers certainly run inside the save. The trainer's own handler (a StopRequest
    that records itself here) tells which signals it took."""
    import trainer.run.entry
    from trainer.signals import StopRequest

    done = threading.Event()
    sent: list[int] = []
    in_write: list[int] = []  # the signals sent while the shard write was held open
    installed: list[StopRequest] = []
    failpoint = faults.at

    class _Recorded(StopRequest):
        def install(self) -> StopRequest:
            installed.append(self)
            return super().install()

    def storm() -> None:
        kinds = itertools.cycle((signal.SIGTERM, signal.SIGUSR2))  # alternate kinds within this one process
        while not done.is_set():
            sig = next(kinds)
            os.kill(os.getpid(), sig)
            sent.append(sig)
            done.wait(0.001)

    def mid_write_hold(point: str, **where) -> None:
        failpoint(point, **where)
        if point != "checkpoint:mid_write" or where["iteration"] != 10:
            return
        start, deadline = len(sent), time.monotonic() + NEVER_S
        while time.monotonic() < deadline and min(sent[start:].count(s) for s in STORM) < 3:
            time.sleep(0.001)  # the main thread: the Python-level handlers run here, mid-save
        in_write.extend(sent[start:])

    def on_step(it: int, loss: float) -> None:
        if it == 10:  # the first one synchronously (the stop is then certain at 10), the rest keep coming
            os.kill(os.getpid(), signal.SIGUSR2)
            threading.Thread(target=storm, daemon=True).start()

    for sig in STORM:  # after run() restores this, late signals are harmless
        signal.signal(sig, lambda *_: None)
    trainer.run.entry.StopRequest, faults.at = _Recorded, mid_write_hold
    r = run_cfg(d, RunHooks(on_step=on_step))
    done.set()
    received = [s for stop in installed for s in stop.received]

    def counts(sigs: list[int]) -> dict[str, int]:
        return {s.name: sigs.count(s) for s in STORM}

    save_json(out, {"code": r.exit_code, "iteration": r.iteration, "sent": counts(sent),
                    "in_write": counts(in_write), "received": counts(received)})


def test_signals_during_save_do_not_corrupt_it(tmp_path, reference):
    data, straight = reference
    d = tiny_config(str(tmp_path / "run"), data, train={"iters": 20, "save_interval": 5})
    spawn(1, str(tmp_path), _signal_storm, d, str(tmp_path / "stopped.json"))
    stopped = load_json(str(tmp_path / "stopped.json"))
    sys.stderr.write(f"signal storm: {stopped}\n")
    assert (stopped["code"], stopped["iteration"]) == (EXIT_REQUEUE, 10), stopped
    # Both kinds, in turn, arrived in the middle of the shard write, and both reached the trainer's handler
    # (a kind sent twice before its handler ran counts once: POSIX signals do not queue).
    assert stopped["in_write"]["SIGTERM"] >= 3 and stopped["in_write"]["SIGUSR2"] >= 3, stopped
    assert abs(stopped["sent"]["SIGTERM"] - stopped["sent"]["SIGUSR2"]) <= 1, stopped
    assert stopped["received"]["SIGTERM"] >= 1 and stopped["received"]["SIGUSR2"] >= 2, stopped
    spawn(1, str(tmp_path), _resume, d, str(tmp_path / "resumed.json"))
    resumed = load_json(str(tmp_path / "resumed.json"))
    assert resumed["code"] == EXIT_OK
    assert all(resumed["losses"][str(i)] == straight[i] for i in range(11, 21))


class _Inject:
    """Multiplies one parameter's gradient by ``value`` during the chosen iterations (a real autograd
    hook, the way an overflow or a NaN reaches the gradients)."""

    def __init__(self, iterations: set[int], value: float) -> None:
        self.iterations, self.value, self.current = iterations, value, 1
        self.snapshots: dict[int, torch.Tensor] = {}
        self.model = None

    def on_build(self, model) -> None:
        self.model = model
        p = dict(model.named_parameters())["encoder.layers.0.mlp.dense_h_to_4h.weight"]
        p.register_hook(lambda g: g * self.value if self.current in self.iterations else g)

    def on_step(self, it: int, loss: float) -> None:
        self.snapshots[it] = torch.cat([p.detach().flatten() for p in self.model.parameters()]).clone()
        self.current = it + 1

    def hooks(self) -> RunHooks:
        return RunHooks(on_build=self.on_build, on_step=self.on_step)


def test_fp16_overflow_skips_step_and_lowers_scale(tmp_path, reference):
    data, _ = reference
    d = tiny_config(str(tmp_path / "run"), data, train={"iters": 20, "precision": "fp16", "log_interval": 1,
                                                        "initial_loss_scale": 1024.0})
    inject = _Inject({6, 7}, math.inf)
    r = run_cfg(d, inject.hooks())
    assert r.exit_code == EXIT_OK and r.iteration == 20 and r.skipped_iters == 2
    snaps = inject.snapshots
    assert torch.equal(snaps[5], snaps[6]) and torch.equal(snaps[6], snaps[7])  # both steps skipped
    assert not torch.equal(snaps[7], snaps[8])  # and training continued
    rows = {row["iteration"]: row for row in map(json.loads, open(tmp_path / "run" / "train_metrics.jsonl"))
            if "train/lr" in row}
    scale = {i: rows[i]["train/loss_scale"] for i in rows}
    # Hysteresis 2: the first overflow keeps the scale, the second halves it; no growth in 1000 steps.
    assert scale[5] == scale[6] == 1024.0 and scale[7] == scale[20] == 512.0
    assert rows[6]["train/skipped_iters"] == rows[7]["train/skipped_iters"] == 1
    assert "train/lm_loss" not in rows[6]
    assert all(math.isfinite(rows[i]["train/lm_loss"]) for i in range(8, 21))
    # The LR schedule advanced through the skipped steps (Megatron: in samples, every iteration).
    assert rows[20]["train/lr"] == pytest.approx(1e-3)


def test_fp16_starts_at_2_pow_32_and_backs_off(tmp_path, reference):
    data, _ = reference
    d = tiny_config(str(tmp_path / "run"), data, train={"iters": 30, "precision": "fp16", "log_interval": 1})
    r = run_cfg(d)
    lines = open(tmp_path / "run" / "train_metrics.jsonl")
    rows = [row for row in map(json.loads, lines) if "train/lr" in row]
    assert rows[0]["train/loss_scale"] == 2.0**32 and r.skipped_iters > 0
    assert rows[-1]["train/loss_scale"] < 2.0**32 and "train/lm_loss" in rows[-1]


def test_nan_in_fp32_stops_and_keeps_last_good_checkpoint(tmp_path, reference):
    data, _ = reference
    d = tiny_config(str(tmp_path / "run"), data, train={"iters": 20, "save_interval": 5})
    inject = _Inject({8}, math.nan)
    r = run_cfg(d, inject.hooks())
    assert r.exit_code == EXIT_NONFINITE and r.iteration == 7
    assert r.reason.startswith("training diverged at iteration 8: gradient norm is not finite"), r.reason
    ckpt_dir = str(tmp_path / "run" / "checkpoints")
    assert ckpt.read_tracker(ckpt_dir) == 5 and ckpt.list_iterations(ckpt_dir) == [5]
    shard = ckpt.load_file(ckpt.shard_path(ckpt_dir, 5, 0, 0, 1))
    assert all(torch.isfinite(t).all() for t in shard["model"]["language_model"]["encoder"].values())
