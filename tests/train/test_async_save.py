"""checkpoint.async_save: the background writer writes the bytes a synchronous save writes, from a copy
that training may change at once; training goes on while a write is held, the next save waits for it, the
stop and the last save are waited for; a failed background write stops every rank at the same step, a
rank killed mid-write leaves the tracker where it was (the single-rank crash points are test_faults.py's,
for both modes)."""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import threading

import pytest
import torch
import torch.multiprocessing as mp

from bench.goodput import flat_tensors
from tests.seam import hook_env
from tests.train.harness import load_json, run_cfg, save_json, spawn, tiny_config, write_dataset
from tests.waits import NEVER_S, wait_until
from trainer import faults
from trainer.checkpoint import protocol as ckpt
from trainer.checkpoint.background import Writer, start_dist_save, start_shard_save
from trainer.checkpoint.dist_write import save_dist_checkpoint
from trainer.checkpoint.staging import HostStager
from trainer.checkpoint.verify import read_manifest
from trainer.signals import EXIT_OK, EXIT_REQUEUE


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_dataset(str(tmp_path_factory.mktemp("data")))


def _trained(tmp_path, data, **optim):
    """A tiny model, optimizer, schedule and loss scaler one Adam step in (moments set), and its facts."""
    from trainer.config import RunConfig
    from trainer.parallel import ParallelState
    from trainer.restore.state import RunFacts
    from trainer.run.entry import build_components

    cfg = RunConfig.from_dict(tiny_config(str(tmp_path / "run"), data, optim=optim))
    c = build_components(cfg, ParallelState.single())
    gen = torch.Generator().manual_seed(0)
    for p in c.model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
    c.parts.optimizer.step()
    return c, RunFacts(cfg.to_dict(), c.global_batch_size, None, "same-run")


def _files(folder: str) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(r, n), folder): open(os.path.join(r, n), "rb").read()
            for r, _, names in os.walk(folder) for n in names}


def _digest(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()[:12]


@pytest.mark.parametrize("distributed", [False, True])
def test_background_write_is_the_synchronous_save_byte_for_byte(tmp_path, data, monkeypatch, distributed):
    """The same state saved both ways: identical files (model_optim_rng.pt, distrib_optim.pt with the
    distributed optimizer, digests, manifest sums), although the live state changed once the host copy
    was made (Writer.before_update, where the loop waits before an update) and before the held background
    write began."""
    from trainer.restore.distrib_optim import extra_files
    from trainer.restore.state import TrainState, build_state, checkpoint_args

    c, facts = _trained(tmp_path, data, distributed=distributed)
    state = TrainState(iteration=4, consumed_train_samples=16)
    args = checkpoint_args(c.gpt, c.model, facts, state)
    files = {ckpt.SHARD_FILE: build_state(c.model, c.parts, args, state, facts.config),
             **extra_files(c.parts.optimizer)}
    layout = ckpt.ShardLayout()
    sync_dir, async_dir = str(tmp_path / "sync"), str(tmp_path / "async")
    ckpt.save_checkpoint(sync_dir, 4, files[ckpt.SHARD_FILE], layout, None,
                         {k: v for k, v in files.items() if k != ckpt.SHARD_FILE})
    go, real = threading.Event(), faults.at

    def held(point: str, **where):
        if point == "checkpoint:before_write":
            assert go.wait(NEVER_S), "the test never released the background write"
        return real(point, **where)

    monkeypatch.setattr(faults, "at", held)
    writer, done = Writer(None), []
    assert start_shard_save(writer, HostStager(), async_dir, 4, files, layout, None, done.append)
    writer.before_update()  # where the loop waits for the host copy before its next update
    with torch.no_grad():  # training goes on: the live parameters and Adam moments change in place
        for p in c.model.parameters():
            p.add_(1.0)
        c.parts.optimizer.step()
    go.set()
    writer.wait()
    assert len(done) == 1 and ckpt.read_tracker(async_dir) == 4
    theirs, ours = (_files(os.path.join(d, "iter_0000004")) for d in (sync_dir, async_dir))
    assert sorted(ours) == sorted(theirs) and len(ours) >= (4 if distributed else 3), sorted(ours)
    differ = {n: (_digest(theirs[n]), _digest(ours[n])) for n in theirs if n != "manifest.json" and
              theirs[n] != ours[n]}
    assert not differ, differ
    sums = [{k: v["sha256"] for k, v in read_manifest(os.path.join(d, "iter_0000004"))["files"].items()}
            for d in (sync_dir, async_dir)]
    assert sums[0] == sums[1]


def test_background_torch_dist_write_is_the_synchronous_one(tmp_path, data):
    """torch_dist through torch.distributed.checkpoint.async_save: the same data files and common.pt, and
    the same tensors in .metadata (its save id differs from save to save, by torch's design)."""
    from torch.distributed.checkpoint import FileSystemReader

    from trainer.restore.dist import dist_content
    from trainer.restore.state import TrainState, checkpoint_args

    c, facts = _trained(tmp_path, data)
    state = TrainState(iteration=4, consumed_train_samples=16)
    args = checkpoint_args(c.gpt, c.model, facts, state)
    content = dist_content(c.model, c.parts, args, state, facts.config)
    sync_dir, async_dir = str(tmp_path / "sync"), str(tmp_path / "async")
    save_dist_checkpoint(sync_dir, 4, *content, ckpt.ShardLayout(), None)
    writer = Writer(None)
    assert start_dist_save(writer, HostStager(), async_dir, 4, content, ckpt.ShardLayout(), None, print)
    writer.before_update()
    with torch.no_grad():
        for p in c.model.parameters():
            p.add_(1.0)
    writer.wait()
    theirs, ours = (_files(os.path.join(d, "iter_0000004")) for d in (sync_dir, async_dir))
    assert sorted(ours) == sorted(theirs)
    same = [n for n in theirs if n.endswith((".distcp", "common.pt", "metadata.json"))]
    assert len(same) >= 3 and all(theirs[n] == ours[n] for n in same), same
    metas = [FileSystemReader(os.path.join(d, "iter_0000004")).read_metadata() for d in (sync_dir, async_dir)]
    assert metas[0].state_dict_metadata == metas[1].state_dict_metadata


def _held_run(rank: int, d: dict, out: str) -> None:
    """The save at 4 is held in its background thread until the training thread has run step 7; a stop
    signal arrives at 10 (after the save at 8 began). Every fault point and step is recorded with its
    thread."""
    events: list[tuple[str, int, str]] = []
    reached, release, real = threading.Event(), threading.Event(), faults.at

    def at(point: str, **where):
        events.append((point, where["iteration"], threading.current_thread().name))
        if point == "checkpoint:mid_write" and where["iteration"] == 4:
            reached.set()
            assert release.wait(NEVER_S), "step 7 never came while the save at 4 was held"
        return real(point, **where)

    def on_step(it: int, loss: float) -> None:
        if it == 5:  # the writer thread may start after step 5 did (seen in CI): step 5 ends once it writes
            assert reached.wait(NEVER_S), "the background write of 4 never began"
        events.append(("step", it, threading.current_thread().name))
        if it == 7:
            release.set()
        if it == 10:
            os.kill(os.getpid(), signal.SIGUSR2)

    faults.at = at
    from trainer.run import RunHooks

    r = run_cfg(d, RunHooks(on_step=on_step))
    save_json(out, {"code": r.exit_code, "iteration": r.iteration, "events": events,
                    "tracker": ckpt.read_tracker(os.path.join(d["run_dir"], "checkpoints"))})


def test_training_goes_on_during_a_write_and_the_next_save_and_the_stop_wait_for_it(tmp_path, data):
    d = tiny_config(str(tmp_path / "run"), data, train={"iters": 20, "save_interval": 4},
                    checkpoint={"keep": None})
    spawn(1, str(tmp_path), _held_run, d, str(tmp_path / "out.json"))
    out = load_json(str(tmp_path / "out.json"))
    assert (out["code"], out["iteration"], out["tracker"]) == (EXIT_REQUEUE, 10, 10)  # stop saved, waited
    events = [tuple(e) for e in out["events"]]
    at = {(p.split(":")[-1], it): i for i, (p, it, _) in enumerate(events)}
    thread = {(p.split(":")[-1], it): t for p, it, t in events}
    # The write of 4 runs in a background thread while the training thread runs steps 5, 6 and 7.
    assert thread[("mid_write", 4)].startswith("slipway-ckpt") and thread[("step", 5)] == "MainThread"
    assert at[("mid_write", 4)] < at[("step", 5)] < at[("step", 7)] < at[("after_tracker", 4)]
    # The save at 8 begins only once 4 is committed; the stop's save at 10 after 8 is, and it is committed
    # before run() returns (the tracker above).
    assert at[("after_tracker", 4)] < at[("before_write", 8)] < at[("after_tracker", 8)] < at[
        ("before_write", 10)] < at[("after_tracker", 10)]
    assert ckpt.list_iterations(d["run_dir"] + "/checkpoints") == [4, 8, 10]


def _fails_on_rank1(rank: int, d: dict, out: str) -> None:
    """Rank 1's background write of iteration 8 finds the disk full. At step 9 each rank waits until its
    own writer thread has ended (so both know of the failure at that step boundary); both report what
    they raise and the last step each ran."""
    real, seen = faults.at, []

    def at(point: str, **where):
        if rank == 1 and point == "checkpoint:mid_write" and where["iteration"] == 8:
            raise OSError(errno.ENOSPC, "No space left on device (test)")
        return real(point, **where)

    def on_step(it: int, loss: float) -> None:
        seen.append(it)
        if it == 9:
            wait_until(lambda: not any(t.name == "slipway-ckpt-8" for t in threading.enumerate()),
                     "the writer thread of iteration 8 to end")

    faults.at = at
    from trainer.run import RunHooks

    try:
        run_cfg(d, RunHooks(on_step=on_step))
        raised = None
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        raised = f"{type(e).__name__}: {e}"
    save_json(f"{out}.{rank}", {"raised": raised, "last_step": seen[-1]})


def test_a_failed_background_write_stops_every_rank_at_the_same_step(tmp_path, data):
    d = tiny_config(str(tmp_path / "run"), data, parallel={"tp_size": 2, "pp_size": 1},
                    train={"iters": 40, "save_interval": 8})
    spawn(2, str(tmp_path), _fails_on_rank1, d, str(tmp_path / "out"))
    outs = [load_json(str(tmp_path / f"out.{r}")) for r in (0, 1)]
    assert all(o["raised"] and o["raised"].startswith("CheckpointSpaceError") for o in outs), outs
    assert "iteration 8" in outs[0]["raised"] and "another rank" in outs[0]["raised"], outs[0]
    # Raised at the step boundary of 9 (agreed with the stop flag), not at the next save (16).
    assert outs[0]["last_step"] == outs[1]["last_step"] == 9, outs
    ckpt_dir = str(tmp_path / "run" / "checkpoints")
    assert ckpt.read_tracker(ckpt_dir) is None and ckpt.list_iterations(ckpt_dir) == []


def _run(rank: int, d: dict, out: str, hooks: dict) -> None:
    os.environ.update(hooks)
    r = run_cfg(d)
    save_json(f"{out}.{rank}", {"code": r.exit_code, "losses": r.losses})


def test_a_rank_killed_mid_write_leaves_the_tracker_and_the_resume_is_exact(tmp_path, data):
    """tp=2: rank 1 is SIGKILLed in its background write of iteration 10 (rank 0's went through): nothing
    of 10 is committed, and the resume from 5 gives the uninterrupted run's losses bit for bit."""
    d = tiny_config(str(tmp_path / "straight"), data, parallel={"tp_size": 2, "pp_size": 1},
                    train={"iters": 16, "save_interval": 5})
    spawn(2, str(tmp_path), _run, d, str(tmp_path / "straight"), {})
    straight = load_json(str(tmp_path / "straight.0"))["losses"]
    d["run_dir"] = str(tmp_path / "run")
    hooks = hook_env(CKPT_FAILPOINT="before_rename@10")
    with pytest.raises(mp.ProcessExitedException):
        spawn(2, str(tmp_path), _run_rank1_hooked, d, str(tmp_path / "killed"), hooks)
    ckpt_dir = str(tmp_path / "run" / "checkpoints")
    assert ckpt.read_tracker(ckpt_dir) == 5
    spawn(2, str(tmp_path), _run, d, str(tmp_path / "resumed"), {})
    resumed = load_json(str(tmp_path / "resumed.0"))
    assert resumed["code"] == EXIT_OK and sorted(map(int, resumed["losses"])) == list(range(6, 17))
    assert all(resumed["losses"][k] == straight[k] for k in resumed["losses"])


def _run_rank1_hooked(rank: int, d: dict, out: str, hooks: dict) -> None:
    _run(rank, d, out, hooks if rank == 1 else {})


def _copy_held_until_the_update_waits(rank: int, d: dict, out: str) -> None:
    """The host copy of the save at 4 is held until the training thread waits for it before its next
    update (or, were it not to wait, until step 5 ended): which came first is recorded."""
    from trainer.checkpoint import staging
    from trainer.run import RunHooks

    waiting, step5, released = threading.Event(), threading.Event(), []
    real_run, real_wait = staging.HostCopy.run, staging.HostCopy.wait

    def run(self):
        if not released:
            wait_until(lambda: waiting.is_set() or step5.is_set(), "the update to wait, or step 5 to end")
            released.append("update waited" if waiting.is_set() else "step 5 ended first")
        return real_run(self)

    def wait(self):
        waiting.set()
        return real_wait(self)

    staging.HostCopy.run, staging.HostCopy.wait = run, wait
    r = run_cfg(d, RunHooks(on_step=lambda it, loss: step5.set() if it == 5 else None))
    save_json(out, {"code": r.exit_code, "released": released})


def test_the_update_after_a_save_waits_for_its_host_copy(tmp_path, data):
    """Training runs the next forward and backward beside the copy but not the update: the checkpoint
    holds the state of its own iteration, the one a synchronous save writes."""
    sync = tiny_config(str(tmp_path / "sync"), data, train={"iters": 6, "save_interval": 4},
                       checkpoint={"keep": None, "async_save": False})
    spawn(1, str(tmp_path), _run, sync, str(tmp_path / "sync"), {})
    d = tiny_config(str(tmp_path / "async"), data, train={"iters": 6, "save_interval": 4},
                    checkpoint={"keep": None})
    spawn(1, str(tmp_path), _copy_held_until_the_update_waits, d, str(tmp_path / "out.json"))
    out = load_json(str(tmp_path / "out.json"))
    assert out == {"code": EXIT_OK, "released": ["update waited"]}, out
    theirs, ours = (ckpt.load_file(ckpt.shard_path(str(tmp_path / r / "checkpoints"), 4, 0, 0, 1))
                    for r in ("sync", "async"))
    for key in ("model", "optimizer"):
        a, b = flat_tensors(theirs[key]), flat_tensors(ours[key])
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), key

