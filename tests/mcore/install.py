"""Install every megatron-core version of ``tests/mcore/versions.py`` into its own folder (idempotent:
an installed version is not downloaded again). ``make mcore`` runs this; so do ``make test``/``test-fast``.

Each version goes to ``<folder>.tmp`` first and is renamed into place, with a stamp written last, so an
interrupted install is redone rather than half-used.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

from tests.mcore.versions import INSTALL_DIR, STAMP, VERSIONS, installed, requirements, target


def install(version: str) -> None:
    final = target(version)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(tmp),
           *requirements(version)]
    subprocess.run(cmd, check=True)
    (tmp / STAMP).write_text(" ".join(requirements(version)) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def main() -> int:
    start = time.monotonic()
    todo = [v for v in VERSIONS if not installed(v)]
    for version in todo:
        install(version)
    done = ", ".join(VERSIONS)
    print(f"megatron-core {done} in {INSTALL_DIR}/ "
          f"({len(todo)} installed now, {time.monotonic() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
