"""Progress for long CPU jobs: a tqdm bar on a terminal, plain log lines in batch jobs (no \\r spam)."""

from __future__ import annotations

import sys
import time

from trainer.log import get_logger

log = get_logger(__name__)
MODES = ("auto", "bar", "log", "none")


class Progress:
    """Tracks documents and bytes; ``total_bytes`` (of the input files as stored) enables percent and ETA.

    ``mode``: "bar" (tqdm), "log" (a line every ``log_interval`` documents), "none", or "auto" (bar when
    stderr is a terminal, else log).
    """

    def __init__(self, total_bytes: int | None, log_interval: int, mode: str = "auto") -> None:
        if mode not in MODES:
            raise ValueError(f"progress mode {mode!r}: use auto, bar, log or none")
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "log"
        self.mode = mode
        self.total = total_bytes or None
        self.interval = max(1, log_interval)
        self.start = time.perf_counter()
        self.docs = self.input_bytes = self.position = 0
        self._next_log = self.interval
        self._bar = None
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, unit="B", unit_scale=True, desc="preprocess",
                             dynamic_ncols=True, smoothing=0.1)

    def update(self, docs: int, input_bytes: int, position: int) -> None:
        """Add ``docs`` documents and ``input_bytes`` uncompressed bytes; ``position`` = file bytes done."""
        self.docs += docs
        self.input_bytes += input_bytes
        if self._bar is not None:
            self._bar.update(position - self.position)
            self._bar.set_postfix(docs=self.docs, refresh=False)
        self.position = position
        if self.mode == "log" and self.docs >= self._next_log:
            self._next_log = (self.docs // self.interval + 1) * self.interval
            log.info("%s", self.line())

    def line(self) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        text = (f"processed {self.docs} documents ({self.docs / elapsed:.0f} docs/s, "
                f"{self.input_bytes / elapsed / 1e6:.2f} MB/s)")
        if self.total and self.position:
            left = elapsed * (self.total - self.position) / self.position
            text += f", {100 * self.position / self.total:.0f}% of input, ETA {left:.0f}s"
        return text

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
