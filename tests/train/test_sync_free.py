"""The training loop synchronises with the device only where it must (issue 39): zero host reads of
device values on an iteration that does not log, evaluate, save or stop.

Counted, per iteration of a real ``trainer.run.run``: every read of a tensor's value on the host (the
dispatcher's ``aten._local_scalar_dense``: ``.item()``, ``float()``, ``bool()``, ``math.isfinite`` of a
tensor), ``Tensor.tolist`` / ``.cpu()`` / ``.numpy()``, and ``torch.cuda.synchronize`` and stream/event
synchronisation. On a CPU run every one of them is what would stall a GPU's queue; on main before issue
39 each non-logging iteration made four (the loss, the gradient norm twice, the stop flag). A call is
counted against the iteration whose step last started (start-up before the first step counts as 0).
The second test runs the same count on both ranks of a data-parallel pair (the stop flag agreed over
gloo, the gradient norm all-reduced). The third holds what the deferred read costs: a NaN in fp32 is
found at the next log line and the run stops there, naming the bad iteration, with nothing saved past it.
"""

from __future__ import annotations

import math
import os
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import trainer.run.entry
import trainer.run.loop
from tests.train.harness import load_json, run_cfg, save_json, spawn, tiny_config, write_dataset
from trainer.checkpoint import protocol as ckpt
from trainer.run import RunHooks
from trainer.signals import EXIT_NONFINITE, EXIT_OK

LOG, ITERS = 5, 12  # log lines at 5 and 10; the end (12) saves
SYNC_POINTS = {5, 10, 12}


class SyncCounter(TorchDispatchMode):
    """Host reads of tensor values, by the iteration whose step last started."""

    def __init__(self) -> None:
        super().__init__()
        self.iteration = 0
        self.counts: Counter = Counter()
        self.what: dict[int, list[str]] = {}

    def hit(self, what: str) -> None:
        self.counts[self.iteration] += 1
        self.what.setdefault(self.iteration, []).append(what)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.hit("item/float/bool of a tensor")
        return func(*args, **(kwargs or {}))


def _counting_train(counter: SyncCounter, monkeypatch) -> None:
    """Count inside trainer.run.loop.train only (start-up and the kernel check are not the loop)."""
    real_train, real_step = trainer.run.loop.train, trainer.run.loop.step

    def step(loop, batches):
        counter.iteration += 1
        return real_step(loop, batches)

    def train(loop, state, stop):
        with counter:
            return real_train(loop, state, stop)

    for name in ("tolist", "cpu", "numpy"):
        real = getattr(torch.Tensor, name)

        def wrapped(self, *a, _real=real, _name=name, **k):
            counter.hit(f"Tensor.{_name}")
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: counter.hit("torch.cuda.synchronize"))
    for cls in (torch.cuda.Stream, torch.cuda.Event):
        monkeypatch.setattr(cls, "synchronize", lambda *a, **k: counter.hit("stream/event synchronize"))
    monkeypatch.setattr(trainer.run.loop, "step", step)
    monkeypatch.setattr(trainer.run.entry, "train", train)


def _config(tmp: str, data: str, **train) -> dict:
    return tiny_config(os.path.join(tmp, "run"), data, train={"iters": ITERS, "log_interval": LOG,
                                                              "eval_interval": None, **train})


def _off_sync_points(counter: SyncCounter) -> dict[int, list[str]]:
    return {it: counter.what[it] for it in range(1, ITERS + 1)
            if it not in SYNC_POINTS and counter.counts[it]}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_dataset(str(tmp_path_factory.mktemp("data")))


def test_no_host_sync_on_iterations_that_do_not_log(tmp_path, data, monkeypatch):
    counter = SyncCounter()
    _counting_train(counter, monkeypatch)
    r = run_cfg(_config(str(tmp_path), data))
    assert r.exit_code == EXIT_OK and r.iteration == ITERS and sorted(r.losses) == list(range(1, ITERS + 1))
    assert counter.iteration == ITERS
    assert not _off_sync_points(counter), f"host syncs on non-logging iterations: {_off_sync_points(counter)}"
    assert counter.counts[LOG] > 0  # the log line does read back (the counter sees reads at all)
    assert all(math.isfinite(x) for x in r.losses.values())


def _pair(rank: int, d: dict, out: str) -> None:
    counter = SyncCounter()
    mp = pytest.MonkeyPatch()
    try:
        _counting_train(counter, mp)
        r = run_cfg(d)
    finally:
        mp.undo()
    save_json(out.format(rank=rank), {"code": r.exit_code, "off": _off_sync_points(counter),
                                      "at_log": counter.counts[LOG]})


def test_no_host_sync_with_two_data_parallel_ranks(tmp_path, data):
    d = _config(str(tmp_path), data)
    out = str(tmp_path / "rank{rank}.json")
    spawn(2, str(tmp_path), _pair, d, out)
    for rank in (0, 1):
        got = load_json(out.format(rank=rank))
        assert got["code"] == EXIT_OK and not got["off"] and got["at_log"] > 0, (rank, got)


def test_nan_in_fp32_is_found_at_the_next_sync_point(tmp_path, data):
    """NaN gradients at iteration 7 (no on_step hook: nothing reads the loss before the log line at 10):
    the run stops with the non-finite exit code at the log line, reports 6 as its last good iteration,
    and the checkpoint at 5 is the newest (the save at 10 never happens)."""
    d = _config(str(tmp_path), data, save_interval=5, log_interval=10)
    calls = {"n": 0}

    def on_build(model) -> None:  # two micro-batches per step: the hook fires twice per iteration
        p = dict(model.named_parameters())["encoder.layers.0.mlp.dense_h_to_4h.weight"]

        def poison(g):
            calls["n"] += 1
            return g * math.nan if (calls["n"] + 1) // 2 == 7 else g

        p.register_hook(poison)

    r = run_cfg(d, RunHooks(on_build=on_build))
    assert r.exit_code == EXIT_NONFINITE and r.iteration == 6, (r.exit_code, r.iteration)
    ckpt_dir = str(tmp_path / "run" / "checkpoints")
    assert ckpt.list_iterations(ckpt_dir) == [5]
    assert all(math.isfinite(r.losses[i]) for i in range(1, 7))


def test_batches_go_through_pinned_memory_with_non_blocking_copies(monkeypatch):
    """On CUDA each batch tensor is pinned and copied with non_blocking=True, so the copy queues behind
    the step in flight; on CPU batches are left as they are. (The read itself overlaps the device's previous
    step because no non-logging iteration synchronises: the tests above.) Recorded on this CPU-only build
    by standing in for the two tensor methods."""
    from trainer.run.host import to_device

    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: calls.append(("pin", t.shape)) or t)
    monkeypatch.setattr(torch.Tensor, "to",
                        lambda t, device, **kw: calls.append(("to", str(device), kw)) or t)
    batch = {"tokens": torch.zeros(2, 8, dtype=torch.long), "labels": torch.ones(2, 8, dtype=torch.long),
             "meta": "not a tensor"}
    assert to_device(batch, torch.device("cpu")) is batch and calls == []
    out = to_device(batch, torch.device("cuda", 0))
    assert out["meta"] == "not a tensor" and set(out) == set(batch)
    assert calls == [("pin", (2, 8)), ("to", "cuda:0", {"non_blocking": True})] * 2, calls
