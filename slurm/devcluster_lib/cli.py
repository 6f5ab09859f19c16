"""Command line of ``slurm/devcluster``.

stdout carries only lines a shell can ``eval``: progress lines are ``# ...`` comments and ``up``/``env`` end
with ``export SLURM_CONF=<path>``, so ``eval "$(slurm/devcluster up)"`` works. Errors go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from . import cluster
from .hosts import NetError
from .install import Refusal, SetupError
from .layout import HOSTS, NODES, SINGLE_HOST, Layout, default_root
from .procs import DaemonError

USAGE = """Examples:
  slurm/devcluster up                  # install if needed, start, wait for every node idle
  eval "$(slurm/devcluster env)"       # then sinfo / srun / sbatch / sacct / submitit work
  slurm/devcluster status
  slurm/devcluster link n2 down        # cut node n2 off the network (and `link n2 up` again)
  slurm/devcluster down                # stop everything it started, remove its network
State folder: --dir, else $DEVCLUSTER_DIR, else .devcluster/ at the repository root."""


def _write(text: str) -> None:
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader left (`up | head -1`): finish the work anyway, writing nowhere.
        sys.stdout = open(os.devnull, "w")


def _say(msg: str) -> None:
    _write("".join(f"# devcluster: {line}\n" for line in msg.splitlines()))


def _out(msg: str) -> None:
    _write(msg + "\n")


def _export(layout: Layout) -> None:
    _write(f"export SLURM_CONF={layout.slurm_conf}\n")


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dir", default=argparse.SUPPRESS, help="state folder (default .devcluster/)")
    parser = argparse.ArgumentParser(prog="devcluster", parents=[common], epilog=USAGE,
                                     description="A real Slurm cluster (2 nodes) on this machine.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", parents=[common], help="install if needed, start, wait until nodes are idle")
    up.add_argument("--single-host", action="store_true",
                    help="lenient: every node is this host (one network, host name and /tmp); by default "
                         "each node is a host of its own (network, UTS and mount namespaces)")
    sub.add_parser("down", parents=[common], help="stop every process this cluster started")
    sub.add_parser("status", parents=[common], help="daemons, nodes and jobs; exit 0 when healthy")
    sub.add_parser("env", parents=[common], help="print `export SLURM_CONF=...` for eval")
    link = sub.add_parser("link", parents=[common], help="take a node's network link down or up")
    link.add_argument("node", choices=NODES)
    link.add_argument("state", choices=("up", "down"))
    return parser


@contextlib.contextmanager
def _exclusive(layout: Layout) -> Iterator[None]:
    """One ``up``/``down`` at a time per state folder (two concurrent ``up`` would start everything twice)."""
    if not layout.root.exists():
        yield  # `down` of a folder that was never created: nothing to guard
        return
    with open(layout.root / "lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"waiting for another devcluster up/down on {layout.root}")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    raw = getattr(args, "dir", None) or os.environ.get("DEVCLUSTER_DIR") or str(default_root())
    layout = Layout(Path(raw).expanduser().resolve())
    try:
        if args.command == "up":
            layout.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            with _exclusive(layout):
                cluster.up(layout, _say, SINGLE_HOST if args.single_host else HOSTS)
            _export(layout)
        elif args.command == "down":
            with _exclusive(layout):
                cluster.down(layout, _say)
        elif args.command == "status":
            return cluster.status(layout, _out)
        elif args.command == "env":
            if not layout.slurm_conf.exists():
                sys.stderr.write(f"devcluster: no cluster in {layout.root}; run: slurm/devcluster up\n")
                return 1
            _export(layout)
        elif args.command == "link":
            cluster.link(layout, args.node, args.state == "up", _say)
    except Refusal as exc:
        sys.stdout.flush()
        sys.stderr.write(f"devcluster {args.command}: {exc}\n")
        return 1
    except (DaemonError, SetupError, NetError) as exc:
        sys.stdout.flush()
        sys.stderr.write(f"devcluster {args.command} failed: {exc}\n")
        if args.command == "up":
            sys.stderr.write("(daemons that started are still running; `slurm/devcluster down` stops them)\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("devcluster: interrupted (run `slurm/devcluster down` to stop what started)\n")
        return 130
    return 0
