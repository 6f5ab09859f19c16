"""Can this job reach W&B? A bounded probe run once by rank 0 before ``wandb.init`` in online mode.

Why: most HPC compute nodes have no route to the internet, and ``wandb.init(mode="online")`` there blocks
for its init timeout (~90 s) and then fails; retried as a training failure that burns minutes of an
allocation per attempt for a monitoring tool. The probe answers in at most ``PROBE_TIMEOUT_S`` (it runs in
a daemon thread joined with that timeout, so a slow DNS lookup is bounded too); when W&B is unreachable
the run logs offline (``wandb sync`` uploads it later) unless ``logging.wandb.require_online`` is set.

Any HTTP answer, an error status included (401, 404), means "reachable": only a connection that cannot
be made or that stays silent is a reason to go offline. Proxies in the environment (HTTPS_PROXY) are
honoured, as W&B honours them. Torch-free: the orchestrator reads :data:`FALLBACK_KEY` for status.
"""

from __future__ import annotations

import os
import re
import shlex
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

DEFAULT_BASE_URL = "https://api.wandb.ai"  # W&B's own default when WANDB_BASE_URL is unset
PROBE_TIMEOUT_S = 5.0
# Keys of {run_dir}/wandb_run.json: trainer.run.metrics.WandbLogger writes it, orchestrator.readback.status
# reads it.
FALLBACK_KEY = "offline_fallback"


class WandbError(RuntimeError):
    """A W&B problem a retry of the training job would repeat (no key, unreachable with
    ``require_online``); ``trainer.signals.permanent_reason`` matches it by name, so it is never retried."""


@dataclass(frozen=True)
class Probe:
    """What the probe found: ``reason`` is None when W&B answered."""

    url: str
    reason: str | None
    elapsed_s: float
    timeout_s: float


# W&B's offline folder of one job of a run: offline-run-<YYYYmmdd_HHMMSS>-<id>, and "-1", "-2" ... appended
# when another job of the same id started within the same second.
_OFFLINE = re.compile(r"offline-run-(?P<stamp>\d{8}_\d{6})-(?P<rest>.+)")


def offline_dirs(wandb_dir: str | os.PathLike, run_id: str) -> list[str]:
    """Every offline folder of W&B run ``run_id`` under ``wandb_dir`` (``<run_dir>/wandb``), in the order
    the jobs that wrote them started: each job that continued the run (a requeue, a retry, a relaunch, the
    eval stage) wrote its own."""
    found = []
    try:
        names = os.listdir(wandb_dir)
    except OSError:
        return []
    for name in names:
        m = _OFFLINE.fullmatch(name)
        if not m or not os.path.isdir(os.path.join(wandb_dir, name)):
            continue
        rest = m["rest"]
        if rest == run_id or (rest.startswith(f"{run_id}-") and rest[len(run_id) + 1:].isdigit()):
            suffix = rest[len(run_id) + 1:]
            found.append((m["stamp"], int(suffix or 0), os.path.join(wandb_dir, name)))
    return [path for *_, path in sorted(found)]


def sync_command(dirs: list[str]) -> str:
    """The command that uploads the offline folders of one run into that one run.

    Every folder is named: ``wandb sync`` (wandb >= 0.28.1, the floor in setup.py) uploads several folders
    of one run id one after another in order of start time (wandb-core's sync, wandb/wandb#10708, in
    ``wandb beta sync`` since 0.24.0; plain ``wandb sync`` routes to it since 0.28.1, wandb/wandb#12093),
    so a requeued run's history arrives whole. The legacy ``wandb sync`` of older clients replayed each
    folder as the whole run and replaced its history unless told ``--append`` (wandb/wandb#3841, #5865);
    today's client has no ``--append`` at all (it refuses the option), so none is printed."""
    return "wandb sync " + " ".join(shlex.quote(str(d)) for d in dirs)


def base_url(environ: dict | None = None) -> str:
    env = os.environ if environ is None else environ
    return (env.get("WANDB_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")


def probe(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> Probe:
    """Try one HTTP GET of ``url``; never takes (much) longer than ``timeout_s``."""
    found: list[str | None] = []

    def attempt() -> None:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s):  # noqa: S310 - the user's W&B server
                found.append(None)
        except urllib.error.HTTPError:
            found.append(None)  # the server answered
        except Exception as e:  # noqa: BLE001 - every other failure is "unreachable", with its words
            found.append(f"{type(e).__name__}: {getattr(e, 'reason', None) or e}")

    start = time.monotonic()
    worker = threading.Thread(target=attempt, name="wandb-probe", daemon=True)
    worker.start()
    worker.join(timeout_s)
    elapsed = time.monotonic() - start
    reason = found[0] if found else f"no answer within {timeout_s:g} s"
    return Probe(url, reason, elapsed, timeout_s)


def unreachable_message(p: Probe) -> str:
    return (f"W&B is unreachable from this node ({p.url}: {p.reason}; probe took {p.elapsed_s:.1f} s, "
            f"bounded at {p.timeout_s:g} s)")
