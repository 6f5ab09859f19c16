"""Install every megatron-core version of ``tests/mcore/versions.py`` into its own folder (idempotent:
an installed version is not downloaded again). ``make mcore`` runs this; so do ``make test``/``test-fast``.

Each version goes to ``<folder>.tmp`` first and is renamed into place, with a stamp written last, so an
interrupted install is redone rather than half-used. The versions that need Python 3.12 are installed by
that Python's pip (it picks their cp312 wheels), and under an older interpreter they get a Python 3.12
virtual environment first (:func:`ensure_env`, also stamped last).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from tests.mcore.versions import (
    INSTALL_DIR,
    PY312,
    PY312_ENV,
    PY312_PACKAGES,
    STAMP,
    VERSIONS,
    installed,
    interpreter,
    needs_env,
    requirements,
    target,
)

# PyTorch's own index of CPU-only wheels (~200 MB); PyPI's Linux torch is the CUDA build, which imports
# only with its NVIDIA libraries (~2.6 GB to download): used when this index cannot be reached.
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def torch_spec() -> str:
    """The project's torch release (this interpreter's, without a local tag such as +cpu)."""
    return f"torch=={metadata.version('torch').split('+')[0]}"


def env_requirements() -> list[str]:
    return [torch_spec(), *PY312_PACKAGES]


def find_python312() -> str:
    """A Python 3.12: $MCORE_PYTHON312, else pyenv's newest 3.12.x, else ``python3.12`` on the PATH."""
    candidates = [os.environ.get("MCORE_PYTHON312", "")]
    roots = {os.environ.get("PYENV_ROOT", ""), os.path.expanduser("~/.pyenv")}
    if shutil.which("pyenv"):
        roots.add(subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip())
    found = [p for root in roots if root for p in glob.glob(f"{root}/versions/3.12.*/bin/python")]
    candidates += sorted(found, key=lambda p: [int(x) for x in Path(p).parents[1].name.split(".")
                                              if x.isdigit()], reverse=True)
    candidates.append(shutil.which("python3.12") or "")
    want = ".".join(map(str, PY312))
    for python in filter(None, candidates):
        probe = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                               capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == want:
            return python
    raise SystemExit(f"tests/mcore/install.py: megatron-core >= 0.17 needs Python {want}, and none was found "
                     f"(tried $MCORE_PYTHON312, pyenv's versions/{want}.* under "
                     f"{sorted(r for r in roots if r)}, "
                     f"python{want} on the PATH): install it (pyenv install {want}) or set MCORE_PYTHON312")


def _unreachable(url: str) -> str | None:
    """Why ``url`` cannot be fetched (None: it can)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=15):
            return None
    except (urllib.error.URLError, OSError) as e:
        return f"{type(e).__name__}: {getattr(e, 'reason', e)}"


def _pip(python: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "pip", "install", "-q", *args], capture_output=True, text=True)


def ensure_env() -> str | None:
    """The Python 3.12 environment of :data:`PY312_ENV` with :func:`env_requirements`; returns what was
    done (None: already there)."""
    wanted = " ".join(env_requirements()) + "\n"
    stamp = PY312_ENV / STAMP
    if stamp.is_file() and stamp.read_text() == wanted:
        return None
    shutil.rmtree(PY312_ENV, ignore_errors=True)
    subprocess.run([find_python312(), "-m", "venv", str(PY312_ENV)], check=True)
    python, spec = PY312_ENV / "bin" / "python", torch_spec()
    unreachable = _unreachable(CPU_INDEX + "/torch/")
    cpu = None if unreachable else _pip(python, "--index-url", CPU_INDEX, "--timeout", "30", f"{spec}+cpu")
    how = f"{spec}+cpu from {CPU_INDEX}"
    if cpu is None or cpu.returncode != 0:
        why = unreachable or (cpu.stderr.strip().splitlines() or ["no output"])[-1][:200]
        print(f"tests/mcore/install.py: no CPU build of {spec} from {CPU_INDEX} ({why}); installing it "
              "from PyPI, the CUDA build (~2.6 GB with its NVIDIA libraries; it runs on the CPU)", flush=True)
        proc = _pip(python, spec)
        if proc.returncode != 0:
            raise SystemExit(f"tests/mcore/install.py: pip could not install {spec} for Python 3.12:\n"
                             f"{proc.stderr[-3000:]}")
        how = f"{spec} from PyPI (CUDA build)"
    subprocess.run([str(python), "-m", "pip", "install", "-q", *PY312_PACKAGES], check=True)
    stamp.write_text(wanted)
    return how


def install(version: str) -> None:
    final = target(version)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [str(interpreter(version)), "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target",
           str(tmp), *requirements(version)]
    subprocess.run(cmd, check=True)
    (tmp / STAMP).write_text(" ".join(requirements(version)) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def main() -> int:
    start = time.monotonic()
    env = ensure_env() if any(needs_env(v) for v in VERSIONS) else None
    todo = [v for v in VERSIONS if not installed(v)]
    for version in todo:
        install(version)
    done = ", ".join(VERSIONS)
    made = f"; Python 3.12 environment {PY312_ENV} made with {env}" if env else ""
    print(f"megatron-core {done} in {INSTALL_DIR}/ ({len(todo)} installed now{made}, "
          f"{time.monotonic() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
