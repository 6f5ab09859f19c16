"""Log capture for tests: every message a logger (and its children) emits while a handler is attached."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


class LogLines(logging.Handler):
    """Keeps each record's message in ``lines``."""

    def __init__(self, level: int = logging.NOTSET) -> None:
        super().__init__(level)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextmanager
def captured(logger: logging.Logger | str = "slipway") -> Iterator[list[str]]:
    """The messages ``logger`` emits inside the block (a list that fills as they come)."""
    target = logging.getLogger(logger) if isinstance(logger, str) else logger
    handler = LogLines()
    target.addHandler(handler)
    try:
        yield handler.lines
    finally:
        target.removeHandler(handler)
