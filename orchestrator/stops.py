"""How a launch that waits for its jobs stops: SIGINT, SIGTERM and SIGHUP all the same way (flow.py cancels
the run's local jobs and exits 128 + the signal), never in the middle of recording and submitting."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


class Interrupted(KeyboardInterrupt):
    """The launcher was told to stop (Ctrl-C, SIGTERM, SIGHUP) while it waited; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class Stops:
    """While a launch waits for its jobs, SIGINT, SIGTERM and SIGHUP all stop it the same way (the default
    of the last two would kill this process and leave the local jobs running: they are in sessions of
    their own, orchestrator/local_jobs.py). Inside :meth:`deferred` (recording and submitting) a signal is
    held until the section ends, so no job is submitted without being recorded."""

    holding: bool = False
    pending: int | None = None

    def _handle(self, signum: int, _frame: object) -> None:
        if self.holding:
            self.pending = self.pending or signum
        else:
            raise Interrupted(signum)

    @contextmanager
    def installed(self) -> Iterator[Stops]:
        before = {sig: signal.signal(sig, self._handle) for sig in STOPS}
        try:
            yield self
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.pending is not None:
            raise Interrupted(self.pending)


@contextmanager
def ignoring_stops() -> Iterator[None]:
    before = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOPS}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
