"""The one vocabulary of configuration checks (torch-free): an issue names the key, the value and the fix.

Every section dataclass of :mod:`trainer.config` lists its own invariants as :class:`ConfigIssue` records
(``problems()``) built with :func:`positive`, :func:`choice` and :func:`issue`; its ``__post_init__``
raises :class:`ConfigError` with all of them. The orchestrator turns the same records into plan problems
(orchestrator/checks/run.py), so a rule is written once and the launcher still reports every problem of a
config at once: it builds the typed config inside :func:`deferred`, where sections record instead of
raising, then asks each section for its ``problems()``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

_DEFERRED: contextvars.ContextVar[bool] = contextvars.ContextVar("slipway_checks_deferred", default=False)
_DECLARED: contextvars.ContextVar[bool] = contextvars.ContextVar("slipway_checks_declared", default=False)


@dataclass(frozen=True)
class ConfigIssue:
    """One broken rule: ``code`` is its class (stable; tests and users match on it), the rest for people."""

    code: str
    key: str
    value: object
    message: str
    fix: str

    def __str__(self) -> str:
        return f"[{self.code}] {self.key}={self.value!r}: {self.message}. Fix: {self.fix}"


class ConfigError(ValueError):
    """A section broke its own rules; ``issues`` lists every one (not just the first)."""

    def __init__(self, issues: Sequence[ConfigIssue]) -> None:
        self.issues = list(issues)
        super().__init__("; ".join(str(i) for i in self.issues))


def issue(code: str, key: str, value: object, message: str, fix: str) -> ConfigIssue:
    return ConfigIssue(code, key, value, message, fix)


def positive(key: str, value: Any, allow_none: bool = False) -> list[ConfigIssue]:
    """``value`` must be a positive number (an integer ≥ 1 for ints); None passes when ``allow_none``."""
    if value is None and allow_none:
        return []
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        return [issue("positive", key, value, "must be a positive number", f"set {key} to a value > 0")]
    return []


def choice(key: str, value: Any, allowed: Sequence[str]) -> list[ConfigIssue]:
    if value in allowed:
        return []
    return [issue("choice", key, value, f"must be one of {', '.join(map(str, allowed))}",
                  f"{key}={allowed[0]}")]


def enforce(issues: Sequence[ConfigIssue]) -> None:
    """Raise :class:`ConfigError` listing ``issues`` unless checks are :func:`deferred`."""
    if issues and not _DEFERRED.get():
        raise ConfigError(issues)


class Section:
    """Mixin of every config section: ``__post_init__`` normalises (``_normalise``: fill derived defaults),
    then raises every broken rule of ``problems()`` at once."""

    def __post_init__(self) -> None:
        if _DECLARED.get():
            return
        self._normalise()
        enforce(self.problems())

    def _normalise(self) -> None:
        pass

    def problems(self) -> list[ConfigIssue]:
        return []


def checks_deferred() -> bool:
    """Inside :func:`deferred`: a config built now is checked later, by its caller or where it runs."""
    return _DEFERRED.get()


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Build configs without raising: the caller collects ``problems()`` itself (all at once)."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


@contextlib.contextmanager
def declared_defaults() -> Iterator[None]:
    """Build sections holding their fields' defaults as declared: no ``_normalise``, no checks.

    For a schema of defaults (the Hydra schema): a derived default such as ``ffn_hidden_size = 4 ×
    hidden_size`` must be derived from the *composed* values when the config is finally built, not baked
    into the schema from the default ``hidden_size`` (the smoke model would get CodeParrot's MLP width).
    """
    token = _DECLARED.set(True)
    try:
        yield
    finally:
        _DECLARED.reset(token)
