"""The devcluster the Slurm tests run on, as the tests see it: its state folder (from SLURM_CONF), whether
its nodes are hosts of their own (slurm/devcluster_lib/hosts.py), their addresses, and their links.

``make test`` brings the cluster up with its nodes as separate hosts; a test that needs that (a node's own
network, host name or /tmp) calls :func:`require_hosts`, which skips on a single-host cluster locally and
fails under CI.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.ci import skip_unless_ci

REPO = Path(__file__).resolve().parents[1]
DEVCLUSTER = REPO / "slurm" / "devcluster"
sys.path.insert(0, str(REPO / "slurm"))
from devcluster_lib import hosts as _hosts  # noqa: E402
from devcluster_lib.layout import NODES, SLURMD0, Layout, Settings, load_settings  # noqa: E402, F401 (re-exported)


def state_dir(environ: dict[str, str] | None = None) -> Path | None:
    """The state folder of the devcluster SLURM_CONF points at (<state>/etc/slurm.conf), or None when it
    points at no devcluster."""
    conf = (os.environ if environ is None else environ).get("SLURM_CONF")
    if not conf:
        return None
    root = Path(conf).resolve().parents[1]
    return root if (root / "state.json").is_file() else None


def layout() -> Layout:
    root = state_dir()
    assert root is not None, "SLURM_CONF names no devcluster state folder"
    return Layout(root)


def settings() -> Settings:
    found = load_settings(layout())
    assert found is not None
    return found


def require_hosts() -> None:
    """Skip (fail under CI) unless the cluster's nodes are hosts of their own."""
    if not settings().hosts:
        skip_unless_ci("the devcluster runs as a single host (`up --single-host`): this test needs its nodes "
                       "as separate hosts (slurm/devcluster up)")


def node_addresses() -> dict[str, str]:
    return _hosts.node_addresses(settings().subnet)


def slurmd_port(node: str) -> int:
    return settings().port(SLURMD0 + NODES.index(node))


def bridge_address() -> str:
    return _hosts.bridge_address(settings().subnet)


def devcluster(*args: str, root: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``slurm/devcluster --dir <state> ARGS`` (the cluster SLURM_CONF names unless ``root``)."""
    where = root or state_dir()
    return subprocess.run([str(DEVCLUSTER), "--dir", str(where), *args], capture_output=True, text=True,
                          timeout=timeout)


def net_leftovers(root: Path) -> list[str]:
    """The namespaces and links of the cluster in ``root`` that exist now (none after its ``down``)."""
    return _hosts.leftovers(Layout(root))


def set_link(node: str, up: bool) -> None:
    res = devcluster("link", node, "up" if up else "down", timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
