"""A full checkpoint filesystem (a real tmpfs, mounted by the test; needs root): the save fails with the path
and the space needed, the previous checkpoint stays the latest and loads, and nothing partial is left.

Where no tmpfs can be mounted the tests skip locally but fail under CI (``CI`` set, as ``.ci/run`` does):
a CI box that cannot run them must say so, not report them as passed-by-skipping.

The devcluster version (a training job whose checkpoint directory is a small tmpfs) is in
tests/orchestrator/test_fault_matrix.py; here one process calls the checkpoint module directly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import tests.ci
from tests.ci import skip_unless_ci
from trainer.checkpoint import protocol as ckpt

LAYOUT = ckpt.ShardLayout()


def _mount_tmpfs(mnt: Path) -> str | None:
    """Mount a 1 MiB tmpfs on ``mnt``; None on success, else why not."""
    if shutil.which("mount") is None:
        return "no mount command"
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True,
                         text=True, timeout=30)
    return None if res.returncode == 0 else res.stderr.strip() or f"mount exited {res.returncode}"


def _require_tmpfs(mnt: Path) -> None:
    """Mount the tmpfs, or skip (locally) / fail (under CI) saying why not."""
    problem = _mount_tmpfs(mnt)
    if problem:
        skip_unless_ci(f"cannot mount a tmpfs here (needs root): {problem}")


@pytest.fixture
def small_fs(tmp_path: Path):
    """A 1 MiB tmpfs; unmounted afterwards."""
    mnt = tmp_path / "ckpt"
    mnt.mkdir()
    _require_tmpfs(mnt)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], timeout=30, check=False)


def _state(mib: float) -> dict:
    return {"iteration": 1, "model": {"w": torch.arange(int(mib * 2**20 / 4), dtype=torch.float32)}}


def _leftovers(d: Path) -> list[str]:
    return [str(p.relative_to(d)) for p in d.rglob("*") if p.name.startswith((".tmp-", ".trash-"))]


def test_precheck_refuses_before_writing(small_fs: Path):
    assert ckpt.save_checkpoint(str(small_fs), 4, _state(0.55), LAYOUT, keep=1)
    with pytest.raises(ckpt.CheckpointSpaceError) as err:
        ckpt.save_checkpoint(str(small_fs), 8, _state(0.55), LAYOUT, keep=1)
    msg = str(err.value)
    assert str(small_fs) in msg and "iteration 8" in msg and "needs ~0.6 MiB" in msg, msg
    assert "latest checkpoint (iteration 4) is unchanged" in msg, msg
    assert ckpt.read_tracker(str(small_fs)) == 4
    assert ckpt.list_iterations(str(small_fs)) == [4] and not _leftovers(small_fs)
    loaded = ckpt.load_file(ckpt.shard_path(str(small_fs), 4, 0, 0, 1))
    assert torch.equal(loaded["model"]["w"], _state(0.55)["model"]["w"])


def test_enospc_during_the_write_cleans_up(small_fs: Path):
    """A state whose size the estimate cannot see (a long Python list) passes the pre-check and then fills
    the disk mid-write: the temporary shard is removed and the error names the path."""
    assert ckpt.save_checkpoint(str(small_fs), 4, _state(0.3), LAYOUT, keep=1)
    big = {"iteration": 8, "blob": list(range(400_000))}  # ~2 MB pickled, estimated at ~70 KB
    with pytest.raises(ckpt.CheckpointSpaceError) as err:
        ckpt.save_checkpoint(str(small_fs), 8, big, LAYOUT, keep=1)
    msg = str(err.value)
    assert "no space left" in msg and str(small_fs / "iter_0000008") in msg, msg
    assert isinstance(err.value.__cause__, RuntimeError | OSError)
    assert ckpt.read_tracker(str(small_fs)) == 4
    assert ckpt.list_iterations(str(small_fs)) == [4] and not _leftovers(small_fs)
    assert os.statvfs(small_fs).f_bfree * os.statvfs(small_fs).f_frsize > 600_000  # the space came back


@pytest.mark.parametrize("in_ci", [True, False], ids=["ci", "local"])
def test_unmountable_tmpfs_fails_under_ci_and_skips_otherwise(tmp_path: Path, monkeypatch, in_ci: bool):
    """The policy above, where ``mount`` fails (a stand-in first on PATH): CI → fail, else skip."""
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "mount").write_text("#!/bin/sh\necho 'mount: only root can do that' >&2\nexit 32\n")
    (shim / "mount").chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setattr(tests.ci, "IN_CI", in_ci)
    (tmp_path / "mnt").mkdir()
    # Catch both outcomes: a skip where a failure is due must fail this test, not skip it.
    with pytest.raises((pytest.fail.Exception, pytest.skip.Exception), match="only root can do that") as e:
        _require_tmpfs(tmp_path / "mnt")
    assert e.type is (pytest.fail.Exception if in_ci else pytest.skip.Exception)
    assert ("must not be skipped here" in str(e.value)) == in_ci
