"""Which build of the compiled kernels a job loads (trainer/extension.py, trainer/kernel_build.py).

- A container job (SLIPWAY_KERNELS_DIR, set by the job script from container.kernels_dir) loads the
  image's build and never the launched checkout's, which is first on PYTHONPATH and was built on the host.
- A build whose stamp names another torch, or other csrc/ sources than the checkout the job runs, is
  refused before it is loaded (a garbage library stands in for it: loading it would fail differently).
- A ``trainer._C`` that another import loaded before the loader (a guarded ``import trainer._C``) is held
  to the same rules: in a container, the checkout's build imported that way is not the image's and is
  reported as not loaded (its ops unused), not recorded as the image's; an image build imported that
  way whose stamp names another torch is refused too; the right build imported early is used.
- What to do is said where the job runs: in a container, not "run make install".
- On CUDA a kernel setting that expects the compiled kernels stops the run at start when there are none;
  on CPU the eager fallback stays.

Each case runs in a fresh interpreter: a process loads the extension once.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer import extension, kernel_build
from trainer.run.kernels import KernelsMissingError, require_compiled

REPO = Path(__file__).resolve().parents[2]
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
ORIGIN = "import json; from trainer import extension; print(json.dumps(extension.origin()))"


def _origin(kernels_dir: Path | None, code: str = ORIGIN) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k != kernel_build.KERNELS_DIR_ENV}
    if kernels_dir is not None:
        env[kernel_build.KERNELS_DIR_ENV] = str(kernels_dir)
    env["PYTHONPATH"] = str(REPO)
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr


def _host_build() -> Path:
    assert extension.load(), f"trainer._C not built here: {extension._STATE.get('error')} (make install)"
    return Path(extension.origin()["path"])


def _stamp(library: Path, **changes) -> None:
    kernel_build.write_stamp(library, torch.__version__, torch.version.cuda, REPO)
    stamp = json.loads(kernel_build.stamp_path(library).read_text())
    kernel_build.stamp_path(library).write_text(json.dumps({**stamp, **changes}))


def test_a_container_job_loads_the_image_build_and_never_the_checkouts(tmp_path):
    image_build = tmp_path / "opt" / "slipway" / "trainer"
    image_build.mkdir(parents=True)
    library = image_build / f"_C{SUFFIX}"
    shutil.copy2(_host_build(), library)  # a build for this Python and torch, at another place
    _stamp(library)
    origin, _ = _origin(image_build)
    assert origin["ok"] and origin["path"] == str(library) and origin["image"], origin


def test_a_build_for_another_torch_is_refused_before_it_is_loaded(tmp_path):
    library = tmp_path / f"_C{SUFFIX}"
    library.write_bytes(b"not a shared library: loading it would fail with 'invalid ELF header'")
    _stamp(library, torch="2.99.0+cpu")
    origin, log = _origin(tmp_path)
    assert not origin["ok"] and "built for torch 2.99.0+cpu" in origin["error"], origin
    assert "ELF" not in origin["error"]
    # The fix is said for a container: the image's build, not `make install`.
    assert "container.kernels_dir" in log and "make install" not in log, log


def test_a_build_from_other_sources_is_refused(tmp_path):
    library = tmp_path / f"_C{SUFFIX}"
    library.write_bytes(b"never loaded")
    _stamp(library, csrc="0123456789abcdef")
    origin, _ = _origin(tmp_path)
    assert not origin["ok"] and "other csrc/ sources (digest 0123456789abcdef)" in origin["error"], origin


# torch first, as in any job (the library needs libc10 loaded), then an import that ignores a failure.
GUARDED_IMPORT = "import torch\ntry:\n    import trainer._C\nexcept ImportError:\n    pass\n"
# What a guarded import elsewhere could load by path (an image build imported before the loader ran).
IMPORT_FROM = ("import importlib.util, sys, torch\n"
               "spec = importlib.util.spec_from_file_location('trainer._C', {path!r})\n"
               "module = importlib.util.module_from_spec(spec); sys.modules['trainer._C'] = module\n"
               "spec.loader.exec_module(module)\n")


def test_a_checkout_build_imported_before_the_loader_is_not_taken_for_the_images(tmp_path):
    image_build = tmp_path / "opt" / "slipway" / "trainer"
    image_build.mkdir(parents=True)
    library = image_build / f"_C{SUFFIX}"
    shutil.copy2(_host_build(), library)
    _stamp(library)
    origin, _ = _origin(image_build, GUARDED_IMPORT + ORIGIN)
    assert not origin["ok"] and origin["image"], origin
    assert origin["path"] == str(_host_build()) and "already imported" in origin["error"], origin
    assert str(library) in origin["error"], origin  # the build the job must run, named


def test_an_image_build_imported_before_the_loader_is_held_to_its_stamp(tmp_path):
    library = tmp_path / f"_C{SUFFIX}"
    shutil.copy2(_host_build(), library)  # loads fine: only its stamp says it is for another torch
    _stamp(library, torch="2.99.0+cpu")
    origin, _ = _origin(tmp_path, IMPORT_FROM.format(path=str(library)) + ORIGIN)
    assert not origin["ok"] and "built for torch 2.99.0+cpu" in origin["error"], origin


def test_the_right_build_imported_before_the_loader_is_used(tmp_path):
    library = tmp_path / f"_C{SUFFIX}"
    shutil.copy2(_host_build(), library)
    _stamp(library)
    origin, _ = _origin(tmp_path, IMPORT_FROM.format(path=str(library)) + ORIGIN)
    assert origin["ok"] and origin["path"] == str(library) and origin["image"], origin
    origin, _ = _origin(None, GUARDED_IMPORT + ORIGIN)  # outside a container: the checkout's
    assert origin["ok"] and origin["path"] == str(_host_build()) and not origin["image"], origin


def test_an_image_without_a_build_says_so(tmp_path):
    origin, log = _origin(tmp_path)
    assert not origin["ok"] and f"no trainer._C for this Python ({sys.implementation.cache_tag})" in \
        origin["error"] and str(tmp_path) in origin["error"], origin
    assert "eager fallbacks" in log


def test_outside_a_container_the_checkouts_build_is_loaded_and_named():
    origin, _ = _origin(None)
    assert origin["ok"] and Path(origin["path"]).parent == REPO / "trainer" and not origin["image"], origin


def test_a_gpu_run_without_compiled_kernels_stops_at_start_with_the_container_fix(tmp_path):
    """On CUDA, kernels=auto/csrc/apex without CUDA kernels raises before training (a ValueError: the job is
    not retried); kernels=eager and any CPU run go on. This machine's build has no CUDA kernels."""
    code = ("from trainer.run.kernels import require_compiled\n"
            "try:\n    require_compiled('auto', 'cuda')\nexcept ValueError as e:\n    print(repr(str(e)))\n")
    env = dict(os.environ, **{kernel_build.KERNELS_DIR_ENV: str(tmp_path)}, PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    message = res.stdout.strip()
    assert "kernels=auto" in message and "container" in message and "nothing was trained" in message, res
    assert "make install" not in message
    with pytest.raises(KernelsMissingError):
        require_compiled("csrc", "cuda")
    require_compiled("eager", "cuda")  # no compiled kernels expected
    require_compiled("auto", "cpu")  # CPU: the eager fallback stays


def test_sources_digest_follows_every_csrc_file(tmp_path):
    shutil.copytree(REPO / "csrc", tmp_path / "csrc")
    before = kernel_build.sources_digest(tmp_path)
    assert before == kernel_build.sources_digest(REPO)
    (tmp_path / "csrc" / "cuda" / "adamw.cu").write_text("// changed\n", encoding="utf-8")
    assert kernel_build.sources_digest(tmp_path) != before
    assert kernel_build.sources_digest(tmp_path / "nothing") is None
