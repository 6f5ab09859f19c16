"""The megatron-core versions the oracle tests run against, what each needs beside it, and the Python
that runs it.

One definition: ``python -m tests.mcore.install`` (called by ``make mcore``) installs exactly these, and
``tests/mcore/harness.py`` parametrises the tests over them. The wheels need only torch, numpy and
packaging, which the project already installs, so each goes in with ``--no-deps``.

From 0.17 the wheels are built for CPython 3.12 only (``Requires-Python >=3.12``; a cp312 ``helpers``
extension), so under the project's Python 3.11 they run in a Python 3.12 virtual environment of their own
(:data:`PY312_ENV`, created by the install from pyenv's or the PATH's ``python3.12``) holding the
project's torch version; on a Python >= 3.12 interpreter they run in it directly.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INSTALL_DIR = ROOT / ".make" / "mcore"

# Beside every version: dist_checkpointing imports psutil (strategies/filesystem_async.py) although no
# megatron-core release lists it as a requirement.
COMMON: tuple[str, ...] = ("psutil",)

# version -> extra requirements installed into the same target folder.
# 0.8.0 imports ``pkg_resources`` (tensor_parallel/random.py, attention.py, dist_checkpointing), which
# setuptools removed in 81; later versions use ``packaging`` directly. From 0.17 the wheel carries
# Megatron-LM's training side (megatron.training: arguments, checkpointing), whose package __init__
# imports ``yaml`` (training/yaml_arguments.py).
VERSIONS: dict[str, tuple[str, ...]] = {
    "0.8.0": ("setuptools<81",),
    "0.10.0": (),
    "0.13.1": (),
    "0.16.1": (),
    "0.17.1": ("pyyaml",),
    "0.18.2": ("pyyaml",),
    "0.19.2": ("pyyaml",),  # the newest on PyPI (checked 2026-12-04)
}

# The versions whose wheels need Python 3.12 (Requires-Python >=3.12, cp312 only).
NEEDS_PY312 = ("0.17.1", "0.18.2", "0.19.2")
PY312 = (3, 12)
PY312_ENV = INSTALL_DIR / "python3.12"  # the virtual environment they run in under an older Python
# What that environment holds besides torch (whose version is the project's own: install.torch_spec).
PY312_PACKAGES: tuple[str, ...] = ("numpy", "packaging")

# Versions that ship Megatron-LM's training side (megatron.training: parse_args, validate_args,
# save_checkpoint, load_checkpoint) in the wheel: the matrix runs Megatron-LM's own checkpoint code there.
HAS_TRAINING = NEEDS_PY312

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
RESULT = "@@mcore-check-result@@ "  # a check worker's answer line (Megatron prints to stdout too)


def target(version: str) -> Path:
    return INSTALL_DIR / version


def requirements(version: str) -> list[str]:
    """What ``pip install --no-deps --target`` installs for ``version`` (also its stamp's content)."""
    return [f"megatron-core=={version}", *COMMON, *VERSIONS[version]]


def needs_env(version: str) -> bool:
    """Whether ``version`` runs in :data:`PY312_ENV` (it needs 3.12 and this interpreter is older)."""
    return version in NEEDS_PY312 and sys.version_info[:2] < PY312


def interpreter(version: str) -> Path:
    """The Python that runs ``version``'s checks."""
    return PY312_ENV / "bin" / "python" if needs_env(version) else Path(sys.executable)


def installed(version: str) -> bool:
    """Installed with exactly today's requirements (a changed list reinstalls), and its interpreter's
    environment too where it needs one."""
    stamp = target(version) / STAMP
    if not (stamp.is_file() and stamp.read_text().split() == requirements(version)):
        return False
    return not needs_env(version) or (PY312_ENV / STAMP).is_file()
