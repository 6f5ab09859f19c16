#!/usr/bin/env python3
"""containers/dev_image.py build|path|sqsh|key: the CPU image the devcluster's container tests run in
(``container=charliecloud``), built here from Debian's packages and PyPI, cached by its inputs.

What is in it, as in the NGC images containers/build.sh and build_sqsh.sh make: a Debian root file system
with its own Python (Debian's python3, not this machine's), the CPU torch and Slipway's dependencies in
/opt/venv, and Slipway at /opt/slipway, installed with ``pip install --no-build-isolation -e`` so that its
compiled kernels are built inside the image, for the image's Python and torch
(/opt/slipway/trainer/_C*.so and the stamp beside it, trainer/kernel_build.py). /ch/environment holds the
image's environment (PATH to /opt/venv first), which ch-run's --set-env reads, and /etc/environment the
same, which enroot reads (container=pyxis). For pyxis the image is also a squashfs file beside the folder
(slipway-<key>.sqsh, what ``enroot import`` makes of an NGC image; ``sqsh`` prints it).

Two layers, each a folder under .make/images/ named by the hash of its inputs (and of the code here that
builds it), so a change rebuilds only what it touches:

- base-<key>: debootstrap of Debian (SUITE, PACKAGES) + venv + torch (TORCH_SPEC) + setup.py's
  requirements. The slow part (a few minutes, once per change of those).
- slipway-<key>: the base (hard links: no copy) + this checkout's setup.py, csrc/, trainer/ and
  orchestrator/, and the kernels compiled in the image (a few minutes on two cores). Keyed by what the
  build reads (setup.py, csrc/, the stamp writer), not by the Python code, which jobs take from the
  launched checkout.

``build`` prints the image's folder on its last line (progress goes to stderr); ``path`` prints it when it
is built (exit 1 otherwise); ``key`` prints both keys. Needs root, debootstrap and ch-run (missing ones are
installed with apt-get, as slurm/devcluster does). pip inside the image uses this machine's pip settings
(index, find-links, constraints, certificates: ``pip config list`` and PIP_* variables), so it finds what
the host's pip finds. Runs after ``make install`` (it reads orchestrator/world/container.py).
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import hashlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from orchestrator.world.container import CH_NAME_FILES as NAME_FILES  # noqa: E402  (ch-run binds onto them)

CACHE = REPO / ".make" / "images"
SUITE = "bookworm"
MIRROR = os.environ.get("SLIPWAY_DEBIAN_MIRROR", "http://deb.debian.org/debian")
PACKAGES = ("python3", "python3-venv", "python3-dev", "g++", "ca-certificates")
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")
# What the Slipway layer copies into /opt/slipway (the rest of the checkout is not needed to build it), and
# what its build depends on (its key): the kernels are compiled from csrc/ by setup.py, and stamped by
# trainer/kernel_build.py. Jobs run the launched checkout's Python code, never the copy in the image, so
# the image is not rebuilt for a change of it.
SLIPWAY_FILES = ("setup.py", "pyproject.toml", "csrc", "trainer", "orchestrator")
SLIPWAY_KEY_FILES = ("setup.py", "pyproject.toml", "csrc", "trainer/kernel_build.py")
VENV = "/opt/venv"
ENVIRONMENT = f"PATH={VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\nLANG=C.UTF-8\n"
KEEP = {"base": 2, "slipway": 3}  # older images of each layer are removed after a build
TOOLS = {"debootstrap": "debootstrap", "ch-run": "charliecloud-runtime", "mksquashfs": "squashfs-tools"}


def say(msg: str) -> None:
    sys.stderr.write(f"# dev_image: {msg}\n")
    sys.stderr.flush()


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _tree_digest(root: Path, names: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for name in names:
        top = root / name
        files = [top] if top.is_file() else sorted(p for p in top.rglob("*") if p.is_file() and _wanted(p))
        for path in files:
            h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _unwanted(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if not _wanted(Path(folder, n))]


def _wanted(path: Path) -> bool:
    """Sources only: no bytecode, no host build of the kernels, no stamps."""
    return "__pycache__" not in path.parts and not path.name.startswith("_C.") and path.suffix != ".pyc"


def requirements() -> list[str]:
    """setup.py's INSTALL_REQUIRES (read, not run), torch replaced by TORCH_SPEC."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in tree.body:
        names = [getattr(t, "id", "") for t in getattr(node, "targets", [])]
        if isinstance(node, ast.Assign) and "INSTALL_REQUIRES" in names:
            reqs = ast.literal_eval(node.value)
            return [TORCH_SPEC] + [r for r in reqs if not re.match(r"torch\b", r)]
    raise RuntimeError("setup.py has no INSTALL_REQUIRES list")


def keys() -> dict[str, str]:
    """Each layer's key: what goes into it, including the code that builds it (not the rest of this file)."""
    recipe = [inspect.getsource(f) for f in (build_base, in_image, pip_settings, _run)]
    base = _digest(recipe, SUITE, MIRROR, PACKAGES, NAME_FILES, ENVIRONMENT, VENV, requirements())
    slipway = _digest(base, inspect.getsource(build_slipway), _tree_digest(REPO, SLIPWAY_KEY_FILES))
    return {"base": base, "slipway": slipway}


def image_dir(layer: str, key: str) -> Path:
    return CACHE / f"{layer}-{key}"


def sqsh_path() -> Path | None:
    """The image of this checkout as a squashfs file (container=pyxis), when built."""
    found = path()
    return found.with_suffix(".sqsh") if found is not None and found.with_suffix(".sqsh").is_file() else None


def _build_sqsh(image: Path) -> None:
    """The image folder as a squashfs file beside it (lz4: seconds to make, quick for enroot to unpack)."""
    target = image.with_suffix(".sqsh")
    if target.is_file():
        return
    work = target.with_name(f".{target.name}.{os.getpid()}")
    _run(["mksquashfs", str(image), str(work), "-comp", "lz4", "-noappend", "-no-progress", "-quiet"])
    work.rename(target)


def path() -> Path | None:
    """The image of this checkout, when built."""
    found = image_dir("slipway", keys()["slipway"])
    return found if (found / "ch" / "environment").is_file() else None


# --- pip settings of this machine, for pip inside the image ---------------------------------------------


def pip_settings() -> tuple[dict[str, str], list[str]]:
    """(PIP_* variables, local folders they name): this machine's pip configuration, so that pip in the
    image resolves packages (and the CPU torch) where the host's pip does."""
    env = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
    res = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    for line in res.stdout.splitlines():
        m = re.match(r"(?:global|install|download|:env:)\.([\w-]+)='(.*)'$", line.strip())
        if m:
            env.setdefault("PIP_" + m.group(1).upper().replace("-", "_"), m.group(2))
    folders = []
    for key, value in env.items():
        for word in value.split():
            local = word[len("file://"):] if word.startswith("file://") else word
            if not (local.startswith("/") and os.path.exists(local)):
                continue
            # A file, or a local index (.../simple) whose pages link to files beside it: bind the parent.
            index = "INDEX" in key and os.path.basename(local.rstrip("/")) == "simple"
            parent = os.path.isfile(local) or index
            folders.append(os.path.dirname(local.rstrip("/")) if parent else local)
    return env, sorted(set(folders))


# --- building -------------------------------------------------------------------------------------------


def _run(argv: list[str], **kw) -> None:
    say(" ".join(argv)[:200])
    res = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=sys.stderr, stderr=sys.stderr, **kw)
    if res.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)[:300]}` failed with status {res.returncode} (output above)")


def ensure_tools() -> None:
    search = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    missing = [t for t in TOOLS if shutil.which(t, path=search) is None]
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RuntimeError(f"missing {', '.join(missing)}: install {' '.join(TOOLS[t] for t in missing)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    _run(["apt-get", "install", "-y", "--no-install-recommends", *(TOOLS[t] for t in missing)], env=env)


def in_image(rootfs: Path, command: str, binds: list[str], env: dict[str, str]) -> None:
    """Run ``command`` (sh -c) in ``rootfs``, writable, as root of the image, with the host's network and
    the variables ``env`` (read from a private file: pip settings may hold an index's credentials)."""
    env_file = rootfs.parent / "build.env"
    fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    variables = {**env, "PATH": f"{VENV}/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    with os.fdopen(fd, "w") as f:
        f.writelines(f"{k}={v}\n" for k, v in variables.items())
    argv = ["ch-run", "-w", "--unset-env=PYTHONPATH", "--unset-env=PYTHONHOME", "--env-no-expand",
            f"--set-env={env_file}", *(f"--bind={b}" for b in binds), str(rootfs), "--", "sh", "-c", command]
    try:
        _run(argv, env=dict(os.environ, USER=os.environ.get("USER", "root")))
    finally:
        env_file.unlink(missing_ok=True)


def build_base(work: Path) -> None:
    rootfs = work / "rootfs"
    _run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(rootfs), MIRROR])
    shutil.rmtree(rootfs / "var" / "cache" / "apt" / "archives", ignore_errors=True)
    (rootfs / "var" / "cache" / "apt" / "archives" / "partial").mkdir(parents=True)
    for name in NAME_FILES:  # ch-run binds the host's onto them: node names resolve as on the host
        (rootfs / name).touch()
    env, folders = pip_settings()
    reqs = " ".join(f"'{r}'" for r in requirements())
    pip = f"{VENV}/bin/pip install --no-cache-dir"
    in_image(rootfs, f"python3 -m venv {VENV} && {pip} setuptools wheel ninja {reqs}", folders, env)
    (rootfs / "etc" / "environment").write_text(ENVIRONMENT)  # enroot's (pyxis's) image environment
    # enroot starts a login shell, and Debian's /etc/profile resets PATH (NGC's Ubuntu leaves it): the
    # venv goes back in front from profile.d, which /etc/profile reads after.
    (rootfs / "etc" / "profile.d" / "slipway-venv.sh").write_text(f'PATH="{VENV}/bin:$PATH"\n')
    (rootfs / "ch").mkdir(exist_ok=True)
    (rootfs / "ch" / "environment").write_text(ENVIRONMENT)


def build_slipway(base: Path, work: Path) -> None:
    rootfs = work / "rootfs"
    _run(["cp", "-al", str(base), str(rootfs)])  # hard links: the base is not copied
    dest = rootfs / "opt" / "slipway"
    dest.mkdir(parents=True)
    for name in SLIPWAY_FILES:
        src = REPO / name
        if src.is_file():
            shutil.copy2(src, dest / name)
        else:
            shutil.copytree(src, dest / name, ignore=_unwanted)
    env, folders = pip_settings()
    jobs = max(len(os.sched_getaffinity(0)), 1)
    in_image(rootfs, f"cd /opt/slipway && MAX_JOBS={jobs} {VENV}/bin/pip install --no-cache-dir --no-deps "
             "--no-build-isolation -e .", folders, env)
    built = sorted((dest / "trainer").glob("_C*.so"))
    if not built or not Path(f"{built[0]}.json").is_file():
        raise RuntimeError(f"the build left no trainer/_C*.so with its stamp in {dest / 'trainer'}")
    # The image's own Python imports its own build: the image is usable, and what a job loads is this.
    in_image(rootfs, f"cd / && {VENV}/bin/python -c 'import torch, trainer._C; print(trainer._C.__file__)'",
             [], {})


def _prune(layer: str, keep_key: str) -> None:
    old = sorted((p for p in CACHE.glob(f"{layer}-*") if p.name != f"{layer}-{keep_key}"),
                 key=lambda p: p.stat().st_mtime, reverse=True)
    for p in old[KEEP[layer] - 1:]:
        say(f"removing old image {p}")
        shutil.rmtree(p, ignore_errors=True)
        p.with_suffix(".sqsh").unlink(missing_ok=True)


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # another checkout building the same image: wait for it
        yield


def _build_layer(layer: str, key: str, make) -> None:
    """Make one layer in a work folder and move its root file system into place (a layer is there when
    its /ch/environment is, which is written last)."""
    target = image_dir(layer, key)
    if (target / "ch" / "environment").is_file():
        return
    started = time.monotonic()
    work = CACHE / f".build-{layer}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        make(work)
        shutil.rmtree(target, ignore_errors=True)  # an earlier build that died half-way
        (work / "rootfs").rename(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    say(f"built the {layer} layer {target} in {time.monotonic() - started:.0f} s")
    _prune(layer, key)


def build() -> Path:
    k = keys()
    if sqsh_path() is not None:
        say(f"cached: {path()} and {sqsh_path()}")
        return image_dir("slipway", k["slipway"])
    ensure_tools()
    with _locked():
        _build_layer("base", k["base"], build_base)
        _build_layer("slipway", k["slipway"], lambda w: build_slipway(image_dir("base", k["base"]), w))
        _build_sqsh(image_dir("slipway", k["slipway"]))
    return image_dir("slipway", k["slipway"])


def _print(found: Path | None, what: str) -> int:
    if found is None:
        sys.stderr.write(f"dev_image: no {what} built for this checkout (containers/dev_image.py build)\n")
        return 1
    sys.stdout.write(f"{found}\n")
    return 0


def main(argv: list[str]) -> int:
    cmd = argv[1] if len(argv) > 1 else "build"
    try:
        if cmd == "build":
            sys.stdout.write(f"{build()}\n")
        elif cmd in ("path", "sqsh"):
            return _print(path() if cmd == "path" else sqsh_path(), "image" if cmd == "path" else "squashfs")
        elif cmd == "key":
            sys.stdout.write(json.dumps(keys()) + "\n")
        else:
            sys.stderr.write("usage: containers/dev_image.py build|path|sqsh|key\n")
            return 2
    except RuntimeError as exc:
        sys.stderr.write(f"dev_image {cmd} failed: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
