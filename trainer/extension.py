"""Loads the compiled extension ``trainer._C`` (built by setup.py) once, and says which build it loaded.

Which build:

- In a container job, ``SLIPWAY_KERNELS_DIR`` (trainer/kernel_build.py; the job script sets it from
  ``container.kernels_dir``) names the folder of the image's own build, e.g. ``/opt/slipway/trainer``: that
  build and no other is loaded. A plain import would not find it: the launched checkout is first on
  PYTHONPATH, so ``import trainer._C`` finds the checkout's build (made on the host, for the host's Python
  and torch) or none, and the image's is shadowed.
- Elsewhere, the checkout's build (``make install``).

Before loading, the build's stamp (kernel_build.py) is checked: a build for another torch or CUDA, or from
other csrc/ sources than the checkout this job runs, is not loaded. A ``trainer._C`` that another import
loaded first is held to the same rules (the build this job must run, its stamp); one that breaks them is
reported as not loaded and its ops are not used. Ops register themselves under
``torch.ops.slipway`` when the library loads. A missing or refused build is not fatal here: eager fallbacks
exist, and it is reported once with what to do (in a container: not ``make install``). On CUDA the run
refuses to train without them when its kernel setting expects them (trainer/run/kernels.py).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

import torch  # libc10 must be loaded before the extension

from trainer import kernel_build
from trainer.log import get_logger

_log = get_logger(__name__)
_STATE: dict[str, object] = {}
NAME = "trainer._C"


def image_kernels_dir() -> str | None:
    """The image's build folder when this job runs in a container (None outside one)."""
    return os.environ.get(kernel_build.KERNELS_DIR_ENV) or None


def _library(folder: str) -> str | None:
    """``folder/_C<suffix>`` for this interpreter's extension suffixes (its ABI), if present."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(folder, "_C" + suffix)
        if os.path.isfile(path):
            return path
    return None


def _find() -> tuple[str | None, str]:
    """(path of the build to load or None, why none)."""
    folder = image_kernels_dir()
    tag = sys.implementation.cache_tag
    if folder is not None:
        path = _library(folder)
        return path, f"no {NAME} for this Python ({tag}) in the image's build folder {folder}"
    spec = importlib.util.find_spec(NAME)
    return (spec.origin if spec is not None else None), f"no {NAME} for this Python ({tag}) in the checkout"


def _import(path: str) -> None:
    spec = importlib.util.spec_from_file_location(NAME, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[NAME]
        raise


def _stamp_problem(path: str) -> str | None:
    """Why the build at ``path`` must not be used by this process (its stamp: kernel_build), or None."""
    stamp = kernel_build.read_stamp(path)
    if stamp is None:
        return None
    csrc = kernel_build.sources_digest(kernel_build.checkout_root())
    return kernel_build.stamp_problem(stamp, torch.__version__, torch.version.cuda, csrc)


def _already_imported(loaded: object) -> dict[str, object]:
    """A ``trainer._C`` some other import loaded before :func:`load` (a plain or guarded ``import
    trainer._C``): it is the build this job runs only if it is the one :func:`_find` picks and its stamp
    holds. Otherwise its ops are registered already and cannot be unloaded: it is reported as not loaded,
    so the run takes the eager fallbacks (or, on CUDA, stops: trainer/run/kernels.py) and its record says
    which build was imported, instead of naming the image's build while running the checkout's."""
    path = getattr(loaded, "__file__", None)
    wanted, why = _find()
    if path is None or wanted is None or os.path.realpath(path) != os.path.realpath(wanted):
        want = f"the build this job must run is {wanted}" if wanted else why
        return {"ok": False, "path": path, "error": f"{NAME} was already imported from {path} before the "
                f"loader ran, but {want}: its ops are not used"}
    problem = _stamp_problem(path)
    if problem:
        return {"ok": False, "path": path, "error": f"{path} was already imported, but {problem}: its ops "
                "are not used"}
    return {"ok": True, "path": path}


def _load() -> dict[str, object]:
    loaded = sys.modules.get(NAME)
    if loaded is not None:  # imported before load() by another import: check what that import found
        return _already_imported(loaded)
    path, why = _find()
    if path is None:
        return {"ok": False, "error": why}
    problem = _stamp_problem(path)
    if problem:
        return {"ok": False, "error": f"{path} not loaded: {problem}", "path": path}
    try:
        _import(path)
    except ImportError as exc:
        return {"ok": False, "error": f"{path} does not load: {exc}", "path": path}
    return {"ok": True, "path": path}


def fix_hint() -> str:
    """What to do about missing kernels, where this job runs."""
    folder = image_kernels_dir()
    if folder is None:
        return "run `make install` (builds csrc/ ahead of time for this Python and torch)"
    return (f"this job runs in a container image, whose kernels are its own build in {folder} "
            "(container.kernels_dir): rebuild the image from this checkout (containers/README.md), or set "
            "container.kernels_dir to a build made inside the image for its Python and torch; kernels=eager "
            "trains without them")


def load() -> bool:
    """Load the build (see the module doc); True when it loaded. Says once which build, or why none."""
    if "ok" not in _STATE:
        _STATE.update(_load())
        if _STATE["ok"]:
            _log.info("compiled extension %s: %s", NAME, describe())
        else:
            _log.warning("compiled extension %s not available (%s); using eager fallbacks. Fix: %s.", NAME,
                         _STATE["error"], fix_hint())
    return bool(_STATE["ok"])


def available() -> bool:
    return load()


def origin() -> dict[str, object]:
    """Which build this process loaded (or why none), with the interpreter and torch it runs and the
    trainer package it imported: what the run records (trainer/run/kernels.py), so a container run shows
    it ran the launched code with the image's kernels."""
    load()
    out = {key: _STATE[key] for key in ("ok", "path", "error") if key in _STATE}
    out.update(image=image_kernels_dir() is not None, python=sys.executable, torch=torch.__version__,
               code=os.path.dirname(os.path.abspath(kernel_build.__file__)))
    return out


def describe() -> str:
    o = origin()
    where = "the image's build" if o["image"] else "the checkout's build"
    return f"{o.get('path')} ({where}; {o['python']}, torch {o['torch']})"


def missing_message(device_type: str) -> str:
    """Why a run on ``device_type`` that expects the compiled kernels cannot have them, and the fix."""
    why = _STATE.get("error") if not load() else f"{NAME} has no {device_type.upper()} kernels"
    return f"the compiled kernels are not available on {device_type} ({why}). Fix: {fix_hint()}"
