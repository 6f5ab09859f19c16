"""Checkpoints verify themselves and fall back: a manifest (sizes, SHA-256, layout) is written last; a
damaged checkpoint is moved aside and the newest good one loaded; a missing or garbage tracker never means
"start over"; ``checkpoint.keep`` never deletes the last good checkpoint to keep a damaged one."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.train.harness import run_cfg, tiny_config, write_dataset
from trainer.checkpoint import protocol as ckpt
from trainer.checkpoint import verify as ckpt_verify


def _save(ckpt_dir: Path, iteration: int, keep: int | None = None) -> None:
    state = {"w": torch.arange(1000, dtype=torch.float32) * iteration, "iteration": iteration}
    assert ckpt.save_checkpoint(str(ckpt_dir), iteration, state, ckpt.ShardLayout(), keep)


def _shard(ckpt_dir: Path, iteration: int) -> Path:
    return Path(ckpt.shard_path(str(ckpt_dir), iteration, 0, 0, 1))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def two(tmp_path) -> Path:
    d = tmp_path / "checkpoints"
    _save(d, 10)
    _save(d, 20)
    return d


def test_manifest_is_written_with_every_file_size_and_checksum(two):
    man = ckpt_verify.read_manifest(str(two / "iter_0000020"))
    (rel, entry), = man["files"].items()
    path = two / "iter_0000020" / rel
    assert rel == "mp_rank_00/model_optim_rng.pt"
    assert (man["iteration"], man["tp_size"], man["pp_size"]) == (20, 1, 1)
    assert entry == {"size": path.stat().st_size, "sha256": ckpt_verify.sha256_file(str(path))}
    assert ckpt_verify.problems(str(two / "iter_0000020"), ckpt.SHARD_FILE) == []


@pytest.mark.parametrize("damage, sizes_see_it", [(_truncate, True), (_flip_one_byte, False)])
def test_damaged_latest_is_moved_aside_and_the_previous_one_loaded(two, damage, sizes_see_it):
    damage(_shard(two, 20))
    # Sizes alone (plan time) catch a truncation; only the checksum catches a same-size corruption.
    assert bool(ckpt_verify.problems(str(two / "iter_0000020"), ckpt.SHARD_FILE, full=False)) == sizes_see_it
    choice = ckpt.select_latest(str(two))
    assert choice.iteration == 10 and list(choice.damaged) == [20]
    assert "model_optim_rng.pt" in choice.warnings[0] and "moved aside" in choice.warnings[0]
    moved = Path(choice.moved[20])
    assert moved.name.startswith("iter_0000020.damaged-") and (moved / "mp_rank_00").is_dir()  # kept
    assert ckpt.list_iterations(str(two)) == [10] and ckpt.read_tracker(str(two)) == 10  # re-pointed
    assert ckpt.load_file(str(_shard(two, 10)))["iteration"] == 10


@pytest.mark.parametrize("tracker", [None, "abc", ""])
def test_missing_or_garbage_tracker_loads_the_newest_verified_checkpoint(two, tracker):
    path = two / ckpt.TRACKER
    path.unlink()
    if tracker is not None:
        path.write_text(tracker)
    choice = ckpt.select_latest(str(two))
    assert choice.iteration == 20, choice
    assert "loading the newest one that verifies" in choice.warnings[0]
    assert ckpt.read_tracker(str(two)) == 20  # the tracker is rewritten to name it


def test_none_verifies_refuses_to_start_over(two):
    _truncate(_shard(two, 10))
    _truncate(_shard(two, 20))
    (two / ckpt.TRACKER).unlink()
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint .* verifies.*Nothing was started"):
        ckpt.select_latest(str(two))


def test_an_empty_directory_starts_fresh(tmp_path):
    assert ckpt.select_latest(str(tmp_path / "nothing")).iteration is None


def test_a_first_save_killed_mid_write_is_no_checkpoint(tmp_path):
    """What a kill inside a run's first save leaves (the shard still in its temporary folder, no manifest,
    no tracker) is not a checkpoint: the run starts fresh instead of refusing to, and the folder is left
    for the next save of that iteration. The real kill: tests/train/test_faults.py."""
    d = tmp_path / "checkpoints"
    partial = d / "iter_0000004" / ".tmp-mp_rank_00-123"
    partial.mkdir(parents=True)
    (partial / ckpt.SHARD_FILE).write_bytes(b"half a shard")
    choice = ckpt.select_latest(str(d))
    assert choice.iteration is None and not choice.damaged, choice
    assert "never completed" in choice.warnings[0] and len(choice.warnings) == 1, choice.warnings
    assert partial.is_dir() and not (d / ckpt.TRACKER).exists()


def test_an_unfinished_save_beside_committed_checkpoints_with_the_tracker_lost(two):
    (two / ckpt.TRACKER).unlink()
    partial = two / "iter_0000030" / ".tmp-mp_rank_00-123"
    partial.mkdir(parents=True)
    choice = ckpt.select_latest(str(two))
    assert choice.iteration == 20 and not choice.damaged and partial.is_dir(), choice
    _truncate(_shard(two, 10))
    _truncate(_shard(two, 20))
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint .* verifies"):  # real ones still count
        ckpt.select_latest(str(two))


def test_checkpoints_without_a_manifest_are_checked_for_completeness(two):
    for it in (10, 20):
        (two / f"iter_{it:07d}" / ckpt_verify.MANIFEST).unlink()
    assert ckpt.select_latest(str(two), act=False).iteration == 20  # e.g. written by Megatron-LM
    _shard(two, 20).write_bytes(b"")
    assert ckpt.select_latest(str(two), act=False).iteration == 10


def test_keep_never_deletes_the_last_good_checkpoint_to_keep_a_damaged_one(two):
    _truncate(_shard(two, 20))
    _save(two, 30, keep=2)
    assert ckpt.list_iterations(str(two)) == [10, 30]  # 20 (damaged) does not count towards keep
    assert any(n.startswith("iter_0000020.damaged-") for n in os.listdir(two))  # moved aside, not deleted


@pytest.mark.parametrize("damage, seen", [(_truncate, "truncated"), (_flip_one_byte, "SHA-256")])
def test_a_run_resumes_from_the_previous_checkpoint_when_the_latest_is_damaged(tmp_path, damage, seen):
    """End to end through the trainer: one damaged shard of the latest checkpoint costs the iterations
    since the previous one, not the run; the warning is logged and recorded for status and the summary.
    A truncation is seen by the sizes before loading; a same-size corruption by the checksums computed
    while the checkpoint loads (trainer.run.choice), after which the one before it is loaded over it."""
    data = write_dataset(str(tmp_path / "data"))
    cfg = tiny_config(str(tmp_path / "run"), data, train={"iters": 15, "save_interval": 5})
    run_cfg(cfg)
    ckpts = tmp_path / "run" / "checkpoints"
    # The reference: the same checkpoints with iteration 15 removed by hand, so it resumes from 10.
    ref = tiny_config(str(tmp_path / "ref"), data, train={"iters": 20, "save_interval": 5})
    shutil.copytree(ckpts, tmp_path / "ref" / "checkpoints")
    shutil.rmtree(tmp_path / "ref" / "checkpoints" / "iter_0000015")
    (tmp_path / "ref" / "checkpoints" / ckpt.TRACKER).write_text("10")
    damage(_shard(ckpts, 15))
    cfg["train"]["iters"] = 20
    resumed, expected = run_cfg(cfg), run_cfg(ref)
    assert sorted(resumed.losses) == list(range(11, 21))  # from iteration 10, the newest good one
    assert resumed.losses == expected.losses
    rows = [json.loads(x) for x in (tmp_path / "run" / ckpt_verify.WARNINGS_FILE).read_text().splitlines()]
    assert len(rows) == 1 and "iteration 15" in rows[0]["warning"] and seen in rows[0]["warning"], rows
    assert any(n.startswith("iter_0000015.damaged-") for n in os.listdir(ckpts))
    assert ckpt_verify.read_warnings(str(tmp_path / "run")) == [rows[0]["warning"]]


def test_a_corrupt_only_checkpoint_found_while_loading_refuses_to_start_over(tmp_path):
    """The checksums fail after the weights were loaded and there is no checkpoint before: the run stops
    (a fresh start over the damaged weights would train from them), nothing is trained."""
    data = write_dataset(str(tmp_path / "data"))
    cfg = tiny_config(str(tmp_path / "run"), data, train={"iters": 5, "save_interval": 5})
    run_cfg(cfg)
    _flip_one_byte(_shard(tmp_path / "run" / "checkpoints", 5))
    cfg["train"]["iters"] = 10
    refused = "no checkpoint in .* verifies: checkpoint iteration 5 .*SHA"
    with pytest.raises(ckpt.CheckpointError, match=refused):
        run_cfg(cfg)


def test_skipped_checkpoints_are_named_in_status_and_the_summary(tmp_path):
    from orchestrator.readback.status import JobRow, format_rows
    from orchestrator.readback.summary import write_summary

    warning = "checkpoint iteration 15 in /x failed verification: /x/iter_0000015/mp_rank_00/..."
    (tmp_path / "run.json").write_text("{}")
    ckpt_verify.record_warnings(str(tmp_path), [warning])
    (tmp_path / ckpt_verify.WARNINGS_FILE).open("a").write('{"cut by a kill')  # ignored, not fatal
    assert ckpt_verify.read_warnings(str(tmp_path)) == [warning]
    assert f"  checkpoint       WARNING: {warning}" in write_summary(str(tmp_path))
    row = JobRow("r1", "train", "42", "RUNNING", checkpoint_warnings=ckpt_verify.read_warnings(str(tmp_path)))
    assert format_rows([row]).splitlines()[-1] == f"CHECKPOINT: run r1: {warning}"
