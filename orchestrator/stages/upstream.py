"""The upstream wait: a stage's job starts only once the stages it needs completed their outputs.

Slurm's ``afterok`` orders the jobs; :func:`wait_for` is the same promise for local jobs, and for Slurm
jobs a guard against a shared filesystem's lag (and storage the nodes do not share, which it names).
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

from orchestrator.world import queue
from orchestrator.world.queue import marker_of, process_alive
from trainer.health import node_name
from trainer.run_files import COMPLETE, FAILED


@dataclass(frozen=True)
class Upstream:
    """A stage this one needs: its output dir and, for local jobs, the controller's pid."""

    output_dir: str
    job_id: str | None = None
    executor: str = "slurm"
    after_any: bool = False  # wait for it to end, whatever its outcome (StagePlan.after_any)


def _job_alive(up: Upstream) -> bool:
    if up.executor != "local" or not up.job_id:
        return True  # Slurm enforces afterok itself; the marker check below is only for shared storage lag
    return process_alive(up.job_id)


def _ended(up: Upstream) -> bool:
    """A local upstream job ended: it wrote its outcome, or its process is gone (a zombie its launcher has
    not reaped yet still answers kill(pid, 0), so the markers are asked first)."""
    return any(marker_of(up.output_dir, m, up.job_id) is not None for m in (COMPLETE, FAILED)) or \
        not _job_alive(up)


# How a stage that did not run because its upstream failed says so (its _FAILED marker's reason, the
# launcher's state line): the one line a downstream stage adds to a failure (afterok).
NOT_RUN = "not run"


class UpstreamFailed(RuntimeError):
    """An upstream stage failed or ended without completing: this stage does not run (afterok)."""


# How long a file another node wrote may take to appear here (a shared filesystem's attribute cache; NFS
# keeps a directory's for up to 60 s by default, acdirmax).
STORAGE_LAG_S = 60.0


class UpstreamNotVisible(FileNotFoundError):
    """An upstream job completed, but its output is not on this node: storage the nodes do not share.
    A FileNotFoundError: a retry on the same nodes would repeat it (trainer.signals.permanent_reason)."""


def wait_for(upstream: list[Upstream], timeout_s: float) -> None:
    """Block until every upstream job completed its output; raise if it failed or ended without completing
    (one marked ``after_any``: until it ended).

    This is Slurm's ``afterok`` for local jobs (and a guard against shared-storage lag under Slurm): an
    upstream with a job id is satisfied only by the marker *that job* wrote, never by one an earlier launch
    or attempt left (queue.marker_of); an upstream without one (a reused complete output) by any. Under
    Slurm the job completed before this one started, so a marker still missing after STORAGE_LAG_S is on
    storage this node does not see (a node-local /tmp, say): :class:`UpstreamNotVisible` names the folder
    and this node."""
    deadline = time.monotonic() + timeout_s
    for up in upstream:
        if up.after_any:  # Slurm's afterany held this job until it ended; a local one is waited for here
            while up.executor == "local" and not _ended(up):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"upstream job {up.job_id} still running after {timeout_s:.0f} s")
                time.sleep(1.0)
            continue
        lag = time.monotonic() + STORAGE_LAG_S if up.executor == "slurm" and up.job_id else float("inf")
        while marker_of(up.output_dir, COMPLETE, up.job_id) is None:
            alive = _job_alive(up)  # read before the markers: a job that just ended has written them
            if marker_of(up.output_dir, FAILED, up.job_id) is not None:
                raise UpstreamFailed(f"{NOT_RUN}: upstream stage {up.output_dir} failed (afterok)")
            if not alive and marker_of(up.output_dir, COMPLETE, up.job_id) is None:
                raise UpstreamFailed(f"{NOT_RUN}: upstream job {up.job_id} ended without completing "
                                     f"{up.output_dir} (afterok)")
            if time.monotonic() > lag:
                raise UpstreamNotVisible(_not_visible(up))
            if time.monotonic() > deadline:
                raise TimeoutError(f"upstream {up.output_dir} not complete after {timeout_s:.0f} s")
            time.sleep(1.0)


def _not_visible(up: Upstream) -> str:
    where = queue.query_slurm([str(up.job_id)])[1].get(str(up.job_id), {}).get("nodes", "")
    return (f"upstream output {up.output_dir}/{COMPLETE} is not on node {node_name()} (host "
            f"{socket.gethostname()}) {STORAGE_LAG_S:.0f} s after its job {up.job_id} completed"
            f"{f' on {where}' if where else ''} (afterok): {up.output_dir} is on storage this node does not "
            "share with the node that wrote it (a node-local /tmp, /var/tmp or /dev/shm?). Put runs_root and "
            "cache_dir on a filesystem every node mounts")
