"""Whether this is CI, and the one rule for a test whose precondition is missing: skip locally, fail in CI.

CI (``.ci/run`` sets ``CI=true``) runs as root on a machine that has everything the suite needs — the
devcluster, namespaces for the eval sandbox, tmpfs mounts. A skip there would silently drop what the
test guards, so there the missing precondition is a failure naming it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def skip_unless_ci(why: str) -> None:
    """Skip the calling test with ``why``; in CI, fail it with ``why`` instead."""
    if IN_CI:
        pytest.fail(f"{why} (CI=true: this must not be skipped here; the CI machine runs as root and has "
                    "what this test needs)", pytrace=False)
    pytest.skip(why)


@contextlib.contextmanager
def small_tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's notation: ``2m``) on the folder ``mnt`` (created), unmounted afterwards:
    a disk that fills up. Mounting needs root: skipped locally without it, a failure in CI."""
    mnt.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                          capture_output=True, text=True, timeout=30) if shutil.which("mount") else None
    if done is None or done.returncode != 0:
        skip_unless_ci(f"cannot mount a tmpfs on {mnt} (needs root): "
                       f"{done.stderr.strip() if done else 'no mount command'}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], timeout=30, check=False)
