"""Hydra's own composition errors, said as Slipway's problems: the key, the value, the fix, one line each.

Hydra refuses an override before Slipway sees the config: ``optim.lrr=3e-4`` ("Could not override
'optim.lrr'. To append to your config use +optim.lrr=3e-4": wrong advice, since the schema has no such
key), ``cluster.time_limit_min=48:00:00`` ("Value '48:00:00' of type 'str' could not be converted to
Integer"). launch.py has Hydra raise its errors instead of printing them (:func:`raised`) and passes them
here: an unknown key becomes the ``unknown_key`` problem the ``+`` form already gets (with its
did-you-mean, orchestrator/base/config_keys.py), a value of the wrong type a ``type`` problem naming the
type the key takes; both exit as configuration problems do (2). Any other Hydra error (a config group
option that does not exist, an override that does not parse) is printed as Hydra prints it, without a
traceback, and exits 1 (EXIT_ERROR) as before. The switch is out of the environment again before any job
is submitted (:func:`composed`): jobs inherit the launcher's environment.
"""

from __future__ import annotations

import os
import re
import traceback
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from orchestrator.base.config_keys import slurm_minutes, unknown_key
from orchestrator.base.problems import PlanError, Problem
from orchestrator.launch.flow import EXIT_ERROR, EXIT_PROBLEMS

FULL_ERROR = "HYDRA_FULL_ERROR"  # Hydra's switch: raise errors instead of printing them
_APPEND = re.compile(r"use \+(?P<key>[^=\s]+)=(?P<value>.*)$", re.M)
_TYPES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


_SET: list[bool] = []  # whether raised() set the switch (not the user), innermost last


@contextmanager
def raised() -> Iterator[bool]:
    """Hydra's errors raised instead of printed while inside (yields False where the user set
    HYDRA_FULL_ERROR: then they get Hydra's full traceback, as they asked)."""
    own = FULL_ERROR not in os.environ
    os.environ[FULL_ERROR] = os.environ.get(FULL_ERROR, "1")
    _SET.append(own)
    try:
        yield own
    finally:
        _SET.pop()
        if own:
            os.environ.pop(FULL_ERROR, None)


def composed() -> None:
    """Every config of the launch is composed: take the switch back out of the environment before any
    job is submitted, so that the jobs (which inherit it) never see it. A user's own setting stays."""
    if _SET and _SET[-1]:
        os.environ.pop(FULL_ERROR, None)


def _field_type(kind: Any, name: str) -> type | None:
    """The type a dataclass field holds (``int`` for ``int | None``), or None."""
    try:
        hint = typing.get_type_hints(kind).get(name)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: no hint then
        return None
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if len(args) == 1 and args[0] in _TYPES else hint if hint in _TYPES else None


def _wrong_type(cause: Any) -> Problem | None:
    """An override whose value the key's type cannot take."""
    key, value, kind = getattr(cause, "full_key", None), getattr(cause, "value", None), \
        getattr(cause, "object_type", None)
    if not key or kind is None:
        return None
    want = _field_type(kind, key.rpartition(".")[2])
    if want is None:
        return None
    minutes = slurm_minutes(value) if key.endswith("_min") and want is int else None
    if minutes is not None:
        return Problem("type", key, value, f"must be an integer number of minutes ({value} = {minutes})",
                       f"{key}={minutes}")
    return Problem("type", key, value, f"must be {_TYPES[want]}; Hydra: {str(cause).splitlines()[0]}",
                   f"set {key} to {_TYPES[want]} (docs/config.md gives each key's type)")


def problem(err: BaseException) -> Problem | None:
    """The Slipway problem Hydra's error ``err`` is, or None (not one this module knows)."""
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    cause = err.__cause__
    if not isinstance(err, ConfigCompositionException) or cause is None:
        return None
    if isinstance(cause, ConfigAttributeError | ConfigKeyError) and getattr(cause, "object_type", None):
        asked = _APPEND.search(str(err))  # the override as given: Hydra's own (wrong) hint repeats it
        full = getattr(cause, "full_key", None) or ""
        value = asked["value"] if asked else None
        issue = unknown_key(cause.object_type, full, value if asked and asked["key"] == full else None)
        # train.foo.bar=3: the section's missing key is foo; the problem shows the override as written.
        return Problem(issue.code, asked["key"] if asked else full, value, issue.message, issue.fix)
    if isinstance(cause, ValidationError):
        return _wrong_type(cause)
    return None


def report(err: BaseException) -> tuple[str, int]:
    """(what to print, the exit code) for a Hydra error that escaped the launch."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(err, HydraException):  # not Hydra's word on the config: a bug, with its traceback
        trace = "".join(traceback.format_exception(err))
        return f"slipway: launch failed unexpectedly:\n{trace}", EXIT_ERROR
    found = problem(err)
    if found is not None:
        return f"{PlanError([found])}\n", EXIT_PROBLEMS  # as the + form's refusal

    text = str(err)
    if isinstance(err.__cause__, OmegaConfBaseException):
        text += f"\n{err.__cause__}"
    return f"{text}\n\nSet the environment variable {FULL_ERROR}=1 for a complete stack trace.\n", EXIT_ERROR
