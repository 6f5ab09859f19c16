"""Loads the compiled extension ``trainer._C`` (built by setup.py) once.

Ops register themselves under ``torch.ops.slipway`` when the library loads. A missing extension is not
fatal for users (eager fallbacks exist) but is reported once, clearly; CI asserts it is present.
"""

from __future__ import annotations

import importlib

import torch  # noqa: F401  (libc10 must be loaded before the extension)

from trainer.log import get_logger

_log = get_logger(__name__)
_STATE: dict[str, object] = {}


def load() -> bool:
    """Import ``trainer._C``; True when it loaded. Warns once when it is missing."""
    if "ok" not in _STATE:
        try:
            importlib.import_module("trainer._C")
            _STATE["ok"] = True
        except ImportError as exc:
            _STATE["ok"] = False
            _STATE["error"] = str(exc)
            _log.warning("compiled extension trainer._C not available (%s); using eager fallbacks. "
                         "Fix: run `make install` (builds csrc/ ahead of time).", exc)
    return bool(_STATE["ok"])


def available() -> bool:
    return load()
