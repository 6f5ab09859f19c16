"""The README's `make demo` / `make test` on a stock Debian 12: make installs into a project virtual
environment (``VENV``, default ``.venv``, from ``BASE_PYTHON``), because the system Python refuses ``pip
install`` (PEP 668); ``VENV=`` or ``PYTHON=`` on the command line install into the current environment; and
the install stamp is keyed by the environment, so a second one is installed, not skipped.

Make runs here on a copy of the Makefile and setup.py in a temporary folder (never this checkout's .make):
``make -n`` (what would run), ``make -q`` (whether the install is up to date) and the venv rule for real.
The real check against a PEP-668 interpreter uses the system Python where it carries the marker (Debian's
/usr/bin/python3): its pip refuses to install, a venv made by the Makefile's rule installs a wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.fixture
def project(tmp_path) -> Path:
    """The Makefile and setup.py, alone in a folder (the install recipe is never run for real)."""
    root = tmp_path / "proj"
    root.mkdir()
    for name in ("Makefile", "setup.py"):
        shutil.copy2(REPO / name, root / name)
    return root


def _make(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VENV", "MAKEFLAGS", "MFLAGS")}
    out = subprocess.run(["make", "-C", str(root), "--no-print-directory", *args], capture_output=True,
                         text=True, timeout=300, env=env)
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


def _stamp(root: Path, *args: str) -> str:
    """The install stamp make would use, from make's own variable database (``-p``)."""
    out = _make(root, "-pn", "install", *args).stdout
    return next(line.split(":=", 1)[1].strip() for line in out.splitlines() if line.startswith("STAMP :="))


def _second_env(tmp_path: Path) -> str:
    """Another environment of this interpreter (a venv: its own sys.prefix)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages",
                    str(tmp_path / "other")], check=True, timeout=120)
    return str(tmp_path / "other" / "bin" / "python")


def test_by_default_make_installs_into_a_project_venv(project):
    plan = _make(project, "-n", "install").stdout
    assert "python3 -m venv --system-site-packages .venv" in plan, plan
    assert ".venv/bin/python -m pip install -q --no-build-isolation -e '.[dev]'" in plan, plan
    assert "\npython3 -m pip install" not in plan  # never into the interpreter's own environment
    custom = _make(project, "-n", "install", "VENV=/opt/env", f"BASE_PYTHON={sys.executable}").stdout
    assert f"{sys.executable} -m venv --system-site-packages /opt/env" in custom
    assert "/opt/env/bin/python -m pip install -q --no-build-isolation -e '.[dev]'" in custom
    for current in (["VENV="], [f"PYTHON={sys.executable}"]):  # the current environment, as before
        plan = _make(project, "-n", "install", *current).stdout
        assert " -m venv " not in plan and "--no-build-isolation -e '.[dev]'" in plan, plan


def test_the_install_stamp_is_keyed_by_the_environment(project, tmp_path):
    other = _second_env(tmp_path)
    first = _stamp(project, "VENV=", f"PYTHON={sys.executable}")
    second = _stamp(project, "VENV=", f"PYTHON={other}")
    assert first != second and first.startswith(".make/")
    (project / first).parent.mkdir(parents=True, exist_ok=True)
    (project / first).touch()  # the first environment is installed (and newer than setup.py)
    assert _make(project, "-q", "install", "VENV=", f"PYTHON={sys.executable}", check=False).returncode == 0
    again = _make(project, "-q", "install", "VENV=", f"PYTHON={other}", check=False)
    assert again.returncode == 1, "a second environment's install was skipped"
    assert f"{other} -m pip install -q --no-build-isolation -e '.[dev]'" in \
        _make(project, "-n", "install", "VENV=", f"PYTHON={other}").stdout
    assert _stamp(project, "VENV=a") != _stamp(project, "VENV=b")  # two project venvs, two stamps


def _probe_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel (installing it needs no index and no build)."""
    name, files = "slipway_venv_probe-0.0.0", {"slipway_venv_probe.py": "OK = True\n"}
    meta = {f"{name}.dist-info/METADATA": "Metadata-Version: 2.1\nName: slipway-venv-probe\nVersion: 0.0.0\n",
            f"{name}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                       "Tag: py3-none-any\n"}
    path = folder / f"{name}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for arc, text in {**files, **meta}.items():
            z.writestr(arc, text)
        z.writestr(f"{name}.dist-info/RECORD", "".join(f"{a},,\n" for a in [*files, *meta])
                   + f"{name}.dist-info/RECORD,,\n")
    return path


def _externally_managed(python: str) -> bool:
    if not os.path.exists(python):
        return False
    stdlib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('stdlib'))"],
                            capture_output=True, text=True, timeout=60).stdout.strip()
    return os.path.exists(os.path.join(stdlib, "EXTERNALLY-MANAGED"))


@pytest.mark.skipif(not _externally_managed(SYSTEM_PYTHON),
                    reason=f"{SYSTEM_PYTHON} is not an EXTERNALLY-MANAGED (PEP 668) interpreter here")
def test_a_pep668_system_python_gets_a_venv_that_installs(project, tmp_path):
    wheel = _probe_wheel(tmp_path)
    refused = subprocess.run([SYSTEM_PYTHON, "-m", "pip", "install", "--no-index", "--no-deps", str(wheel)],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "externally-managed-environment" in refused.stderr, refused.stderr
    venv = tmp_path / "venv"
    args = [f"VENV={venv}", f"BASE_PYTHON={SYSTEM_PYTHON}"]
    _make(project, f"{venv}/pyvenv.cfg", *args)  # the Makefile's rule, for real
    python = str(venv / "bin" / "python")
    plan = _make(project, "-n", "install", *args).stdout
    assert f"{python} -m pip install -q --no-build-isolation -e '.[dev]'" in plan, plan
    done = subprocess.run([python, "-m", "pip", "install", "--no-index", "--no-deps", str(wheel)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    probe = subprocess.run([python, "-c", "import slipway_venv_probe, sys; print(slipway_venv_probe.OK, "
                                          "sys.prefix)"], capture_output=True, text=True, timeout=60)
    assert probe.stdout.split() == ["True", str(venv)], probe.stdout + probe.stderr
