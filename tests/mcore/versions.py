"""The megatron-core versions the oracle tests run against, and what each needs beside it.

One definition: ``python -m tests.mcore.install`` (called by ``make mcore``) installs exactly these, and
``tests/mcore/harness.py`` parametrises the tests over them. The wheels need only torch, numpy and
packaging, which the project already installs, so each goes in with ``--no-deps``.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INSTALL_DIR = ROOT / ".make" / "mcore"

# version -> extra requirements installed into the same target folder.
# 0.8.0 imports ``pkg_resources`` (tensor_parallel/random.py, attention.py, dist_checkpointing), which
# setuptools removed in 81; later versions use ``packaging`` directly.
VERSIONS: dict[str, tuple[str, ...]] = {
    "0.8.0": ("setuptools<81",),
    "0.10.0": (),
    "0.13.1": (),
    "0.16.1": (),  # the newest on PyPI (checked 2026-12-03); imports and runs on torch 2.13
}

STAMP = ".installed"


def target(version: str) -> Path:
    return INSTALL_DIR / version


def installed(version: str) -> bool:
    return (target(version) / STAMP).is_file()
