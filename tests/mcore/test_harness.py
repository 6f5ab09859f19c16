"""The oracle's own plumbing: a missing version fails under CI (never a skip), the install is idempotent
and keyed on the requirement list."""

from __future__ import annotations

import pytest

from tests import ci
from tests.mcore import harness, versions


def test_a_missing_version_fails_under_ci_and_skips_locally(tmp_path, monkeypatch):
    monkeypatch.setattr(versions, "INSTALL_DIR", tmp_path)
    monkeypatch.setattr(ci, "IN_CI", True)
    with pytest.raises(pytest.fail.Exception, match="not installed .*make mcore"):
        harness.require("0.8.0")
    monkeypatch.setattr(ci, "IN_CI", False)
    with pytest.raises(pytest.skip.Exception, match="make mcore"):
        harness.require("0.8.0")


def test_a_changed_requirement_list_reinstalls(tmp_path, monkeypatch):
    monkeypatch.setattr(versions, "INSTALL_DIR", tmp_path)
    (tmp_path / "0.8.0").mkdir()
    stamp = tmp_path / "0.8.0" / versions.STAMP
    stamp.write_text("megatron-core==0.8.0\n")  # an older list (before psutil)
    assert not versions.installed("0.8.0")
    stamp.write_text(" ".join(versions.requirements("0.8.0")) + "\n")
    assert versions.installed("0.8.0")


def test_a_worker_reports_a_failing_check_and_serves_the_next():
    """A check that raises is answered with its traceback (the worker lives on: the next check runs in the
    same interpreter), and closing ends the process. Its own Worker, not the suite's current one."""
    version = "0.16.1"
    harness.require(version)
    worker = harness.Worker(version)
    try:
        with pytest.raises(AssertionError, match=r"check no_such_check failed \(raised\)[\s\S]*KeyError"):
            worker.ask("no_such_check", {}, timeout=300)
        answer = worker.ask("blends", {"cases": []}, timeout=300)
        assert answer["blends"] == [] and answer["megatron_core"] == version
    finally:
        worker.close()
    assert not worker.alive() and worker.proc.returncode == 0
