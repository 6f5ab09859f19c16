"""What a build of the compiled kernels (``trainer._C``) was made for, torch-free: setup.py writes it beside
the library, trainer/extension.py checks it before loading one, and the orchestrator names the folder a
container job loads its kernels from.

A build is bound to the Python ABI (its file name: ``_C.cpython-311-x86_64-linux-gnu.so``), the torch and
CUDA it was compiled against, and the ``csrc/`` sources it was compiled from. The stamp
(``<library>.json``) records the last three, so a job can refuse a build made for another torch, or from
other sources than the code it runs, instead of loading it (a missing symbol at best; at worst it loads
and its ops are not the ones this code calls).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

# Set by container jobs (orchestrator/render.py, from container.kernels_dir): the folder, inside the image,
# of the image's own build. The job runs the launched checkout (first on PYTHONPATH), whose trainer/_C* was
# built on the host for another Python or torch, or not at all; the image's build is the one that matches.
KERNELS_DIR_ENV = "SLIPWAY_KERNELS_DIR"
STAMP_SUFFIX = ".json"
SOURCES = "csrc"


def sources_digest(repo: str | os.PathLike) -> str | None:
    """sha256 (16 hex digits) of every file under ``<repo>/csrc`` (relative path and bytes), or None when
    the checkout has no csrc/ (an installed, non-editable package)."""
    root = Path(repo) / SOURCES
    if not root.is_dir():
        return None
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def checkout_root() -> Path:
    """The checkout this process runs (``<root>/trainer`` is this package)."""
    return Path(__file__).resolve().parents[1]


def stamp_path(library: str | os.PathLike) -> Path:
    return Path(f"{library}{STAMP_SUFFIX}")


def write_stamp(library: str | os.PathLike, torch_version: str, cuda_version: str | None,
                repo: str | os.PathLike) -> Path:
    """Record beside ``library`` what it was built for (setup.py, after each build)."""
    path = stamp_path(library)
    path.write_text(json.dumps({"python": sys.implementation.cache_tag, "torch": torch_version,
                                "cuda": cuda_version, "csrc": sources_digest(repo)}, indent=1) + "\n")
    return path


def read_stamp(library: str | os.PathLike) -> dict | None:
    """The stamp of ``library``, or None for a build made before stamps (it is loaded unchecked)."""
    path = stamp_path(library)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def stamp_problem(stamp: dict, torch_version: str, cuda_version: str | None, csrc: str | None) -> str | None:
    """Why a build with ``stamp`` must not be loaded by this process, or None."""
    if stamp.get("torch") != torch_version or stamp.get("cuda") != cuda_version:
        return (f"it was built for torch {stamp.get('torch')} (CUDA {stamp.get('cuda')}), this process runs "
                f"torch {torch_version} (CUDA {cuda_version})")
    if csrc and stamp.get("csrc") and stamp["csrc"] != csrc:
        return (f"it was built from other csrc/ sources (digest {stamp['csrc']}) than the checkout this job "
                f"runs ({csrc}): its ops may not be the ones this code calls")
    return None
