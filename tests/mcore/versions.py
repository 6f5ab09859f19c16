"""The megatron-core versions the oracle tests run against, and what each needs beside it.

One definition: ``python -m tests.mcore.install`` (called by ``make mcore``) installs exactly these, and
``tests/mcore/harness.py`` parametrises the tests over them. The wheels need only torch, numpy and
packaging, which the project already installs, so each goes in with ``--no-deps``.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INSTALL_DIR = ROOT / ".make" / "mcore"

# Beside every version: dist_checkpointing imports psutil (strategies/filesystem_async.py) although no
# megatron-core release lists it as a requirement.
COMMON: tuple[str, ...] = ("psutil",)

# version -> extra requirements installed into the same target folder.
# 0.8.0 imports ``pkg_resources`` (tensor_parallel/random.py, attention.py, dist_checkpointing), which
# setuptools removed in 81; later versions use ``packaging`` directly.
VERSIONS: dict[str, tuple[str, ...]] = {
    "0.8.0": ("setuptools<81",),
    "0.10.0": (),
    "0.13.1": (),
    "0.16.1": (),  # the newest on PyPI (checked 2026-12-03); imports and runs on torch 2.13
}

# How a GPTModel's weights are saved in the export test. The torch_dist writer of 0.8.0 and 0.10.0
# (dist_checkpointing/strategies/filesystem_async.py) calls torch's private _write_item with its torch
# 2.3 signature and fails on torch 2.13 ("_write_item() missing 2 required positional arguments"; 0.10.0
# then hangs in its async writer); those versions export in Megatron-LM's --ckpt-format torch instead.
EXPORT_FORMAT = {"0.8.0": "torch", "0.10.0": "torch"}

# Versions whose dist_checkpointing reads common.pt with a bare torch.load (strategies/common.py), which
# torch >= 2.6 makes weights-only: they refuse any checkpoint's argparse.Namespace args, Megatron-LM's own
# too, unless the caller allows it (torch.serialization.add_safe_globals([argparse.Namespace]); 0.13
# passes weights_only=False, 0.16 registers Namespace on import). The torch_dist check asserts this error.
COMMON_NEEDS_NAMESPACE = ("0.8.0", "0.10.0")

STAMP = ".installed"


def target(version: str) -> Path:
    return INSTALL_DIR / version


def requirements(version: str) -> list[str]:
    """What ``pip install --no-deps --target`` installs for ``version`` (also its stamp's content)."""
    return [f"megatron-core=={version}", *COMMON, *VERSIONS[version]]


def installed(version: str) -> bool:
    """Installed with exactly today's requirements (a changed list reinstalls)."""
    stamp = target(version) / STAMP
    return stamp.is_file() and stamp.read_text().split() == requirements(version)
