"""The one way a test waits: on an event (a file, a log line, a count, a job state), with time only as a
generous upper bound for "it never happened".

A test whose verdict depends on how fast this machine is fails by chance on a loaded one (CI's two cores,
a busy login node) and blocks every landing. So tests never sleep a fixed time and then look; they poll
the condition they mean, and the bounds below only turn "it never happened" into a failure with a message.
Where a product timeout is what the test is about (the hang watchdog, the preflight), the test drives it
with a scaled parameter or a virtual clock (``tests/health``), never races it.

``make test-stress`` (tests/stress.py) runs the timing-sensitive files repeatedly under CPU hogs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

NEVER_S = 120.0
"""An event that should follow promptly (a process reaching a step, a file appearing, a heartbeat):
waiting this long without it means it never happened. Hundreds of times what a quiet machine needs."""

JOB_S = 900.0
"""A whole Slurm or local job (queueing, start-up, a few training steps, conversion) reaching its end."""

POLL_S = 0.05
"""How often a condition is looked at (cheap conditions; Slurm queries pass a slower ``poll_s``)."""


def wait_until(cond: Callable[[], T], what: str, timeout_s: float = NEVER_S, poll_s: float = POLL_S) -> T:
    """Return the first truthy value of ``cond()``; fail naming ``what`` after ``timeout_s`` without one."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)
