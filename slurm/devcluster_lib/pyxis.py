"""pyxis + enroot on the devcluster, where this machine has them installed (NVIDIA's container runtime for
Slurm; no package of either exists for Debian, PyPI or npm, so ``up`` never installs them: a site builds
them from their releases, and so can a developer's machine, slurm/README.md).

When both are found, ``up`` loads pyxis through plugstack.conf (``container=pyxis`` jobs then run in their
image: tests/orchestrator/test_container_pipeline.py) and gives enroot one set of folders per node: all the
slurmd daemons share this machine, and the two nodes of a step create a container of the same name at
once (on a site each node has its own local disk). enroot expands ``${SLURMD_NODENAME}`` from the job's
environment, which pyxis passes to it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .layout import Layout

# Where `make install` of pyxis puts its plugin (prefix /usr/local), and Debian's Slurm plugin folder.
PLUGINS = (Path("/usr/local/lib/slurm/spank_pyxis.so"),
           Path("/usr/lib/x86_64-linux-gnu/slurm-wlm/spank_pyxis.so"))
# pyxis runs `enroot` from slurmstepd's PATH, and in the job epilog from /usr/local/bin:/usr/bin:/bin: an
# epilog that cannot list containers fails, and Slurm drains the node. So enroot must be in one of these.
ENROOTS = (Path("/usr/local/bin/enroot"), Path("/usr/bin/enroot"))
DROP_IN = "90-slipway-devcluster.conf"


@dataclass(frozen=True)
class Pyxis:
    plugin: Path
    enroot: Path
    sysconf: Path  # enroot's configuration folder (its script names it)


def find() -> Pyxis | None:
    """The installed pyxis plugin and enroot, when both are here."""
    plugin = next((p for p in PLUGINS if p.is_file()), None)
    enroot = next((p for p in ENROOTS if p.is_file()), None)
    if plugin is None or enroot is None:
        return None
    return Pyxis(plugin, enroot, _sysconf(enroot))


def _sysconf(enroot: Path) -> Path:
    found = re.search(r'ENROOT_SYSCONF_PATH\s+"([^"]+)"', enroot.read_text(errors="replace"))
    return Path(found.group(1) if found else "/etc/enroot")


def drop_in(sysconf: Path) -> Path:
    return sysconf / "enroot.conf.d" / DROP_IN


def describe(found: Pyxis | None) -> str:
    if found is None:
        plugins, enroots = (" or ".join(str(p.parent) for p in paths) for paths in (PLUGINS, ENROOTS))
        return (f"pyxis: not installed (no {PLUGINS[0].name} in {plugins} with enroot in {enroots}): "
                "container=pyxis jobs are refused by the plan (slurm/README.md)")
    return f"pyxis: {found.plugin} with {found.enroot} (container=pyxis runs in the image)"


def plugstack(layout: Layout, found: Pyxis | None) -> str:
    """plugstack.conf's line for pyxis ("" without it). container_scope=job: a named container lives as
    long as its job, not on the node forever."""
    if found is None:
        return ""
    return f"required {found.plugin} runtime_path={layout.root / 'pyxis'} container_scope=job\n"


def enroot_folders(layout: Layout) -> str:
    """The drop-in giving enroot its folders under the cluster's state, one set per node."""
    state, node = layout.root / "enroot", "${SLURMD_NODENAME:-login}"
    return "".join(f"{key} {value}\n" for key, value in (
        ("ENROOT_RUNTIME_PATH", f"{state}/run/{node}"),
        ("ENROOT_CACHE_PATH", f"{state}/cache"),
        ("ENROOT_DATA_PATH", f"{state}/data/{node}"),
        ("ENROOT_TEMP_PATH", f"{state}/tmp"),
    ))


def release(layout: Layout) -> Path | None:
    """Remove this cluster's enroot drop-in (``down``): enroot is the host's, and would otherwise keep its
    folders under a state folder that may be deleted. Another cluster's drop-in (the last ``up`` writes it)
    is left alone. Returns the file removed."""
    for enroot in (p for p in ENROOTS if p.is_file()):
        path = drop_in(_sysconf(enroot))
        if path.is_file() and path.read_text() == enroot_folders(layout):
            path.unlink()
            return path
    return None
