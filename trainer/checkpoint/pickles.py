"""Reading Megatron-LM's pickles without Megatron and without running code from the file.

A Megatron checkpoint pickles more than tensors: ``args`` is an ``argparse.Namespace`` holding Megatron's
own classes (``megatron.core.enums.ModelType``; newer tags add ``rerun_state_machine`` state), torch
dtypes, and ``rng_state`` holds numpy arrays. :func:`load` reads such a file with torch's restricted
``weights_only`` unpickler (no arbitrary callable can run) and allows exactly:

- what ``weights_only`` allows by itself (tensors, containers, primitives, torch dtypes);
- ``argparse.Namespace`` and the numpy pieces of an RNG state;
- every ``megatron.*`` global the file names, each replaced by an inert stand-in (:class:`MegatronObject`:
  it records its constructor arguments and state, and has no behaviour), so Megatron need not be
  installed and none of its code runs.

Anything else is refused with :class:`UnsafePickle`, naming the globals; the caller decides whether the
user may opt into a full unpickle (``--trust-pickle``).
"""

from __future__ import annotations

import argparse
import pickle
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

MEGATRON_PREFIX = "megatron."


class UnsafePickle(pickle.UnpicklingError):
    """The file pickles globals outside the allowed set; ``names`` lists them."""

    def __init__(self, path: str, names: list[str]) -> None:
        self.names = names
        super().__init__(f"{path} pickles objects outside what Slipway reads safely: {', '.join(names)}")


class MegatronObject:
    """An inert stand-in for one of Megatron's classes (an enum member, a dataclass, ...)."""

    qualname = "megatron.?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state

    @property
    def value(self) -> Any:
        """An enum member's value (``ModelType(1)`` pickles as the class called with 1)."""
        return self.args[0] if len(self.args) == 1 else self.args

    def __repr__(self) -> str:
        return f"<{self.qualname}{self.args!r}>"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and (self.args, self.kwargs) == (other.args, other.kwargs)

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.args))


def stand_in(qualname: str) -> type[MegatronObject]:
    """A fresh inert class for Megatron's ``qualname`` (e.g. ``megatron.core.enums.ModelType``)."""
    return type(qualname.rsplit(".", 1)[-1], (MegatronObject,), {"qualname": qualname})


def _numpy_globals() -> list:
    """The numpy pieces an RNG state needs; plain data."""
    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        allowed += [getattr(dtypes, n) for n in dir(dtypes) if n.endswith("DType")]
    return allowed


@contextmanager
def allowed(megatron_names: list[str] = ()):  # type: ignore[assignment]
    """``torch.load(weights_only=True)`` also accepts Namespace, numpy RNG states and the named
    Megatron globals (as stand-ins) inside this block."""
    extra: list = [argparse.Namespace, *_numpy_globals()]
    extra += [(stand_in(n), n) for n in megatron_names]
    with torch.serialization.safe_globals(extra):
        yield


def load(path: str, *, mmap: bool = True) -> Any:
    """``torch.load`` of a Slipway or Megatron-LM file with only the allowed globals (module docstring).

    Raises :class:`UnsafePickle` for any other global, ``RuntimeError``/``OSError`` for unreadable files.
    """
    try:
        with allowed():
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:
        pass  # a global outside the default set: look at which ones the file names
    names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    megatron = [n for n in names if n.startswith(MEGATRON_PREFIX)]
    base = {"argparse.Namespace"} | {f"{g.__module__}.{g.__qualname__}" for g in _numpy_globals()}
    refused = [n for n in names if n not in megatron and n not in base]
    if refused:
        raise UnsafePickle(str(path), refused)
    with allowed(megatron):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
