"""Reading Megatron-LM's pickles without Megatron and without running code from the file.

A Megatron checkpoint pickles more than tensors: ``args`` is an ``argparse.Namespace`` holding Megatron's
own classes (``megatron.core.enums.ModelType``; newer tags add ``rerun_state_machine`` state, attention
backend enums), standard-library enums (from core_v0.19 ``exit_signal = signal.SIGTERM``), torch dtypes,
and ``rng_state`` holds numpy arrays. :func:`load` reads such a file with torch's restricted
``weights_only`` unpickler (no arbitrary callable can run) and allows exactly:

- what ``weights_only`` allows by itself (tensors, containers, primitives, torch dtypes);
- ``argparse.Namespace`` and the numpy pieces of an RNG state;
- standard-library enums (``signal.Signals`` …): a global ``module.Name`` whose module is a
  standard-library module that is already imported (nothing is imported for the file) and whose ``Name``
  is an :class:`enum.Enum` with members. The file gets a one-argument lookup under that name, not the
  class: unpickling a member only looks it up by value. With the class itself, the file could also call it
  with more arguments (``enum.Enum("X", ...)`` makes a class) or ``BUILD`` state into the member it got
  back, and members are process-wide singletons: ``signal.SIGTERM`` renamed for the rest of the process.
  Any other standard-library class (``logging.FileHandler``: it opens a file when called) is refused;
- every ``megatron.*`` global the file names, each replaced by an inert stand-in (:class:`MegatronObject`:
  it records its constructor arguments and state, and has no behaviour), so Megatron need not be
  installed and none of its code runs.

Anything else is refused with :class:`UnsafePickle`, naming the globals; the caller decides whether the
user may opt into a full unpickle (``--trust-pickle``: :func:`load_trusted`, which still needs no
Megatron install).
"""

from __future__ import annotations

import argparse
import enum
import pickle
import signal  # noqa: F401 - imported so that its enums (Megatron's args.exit_signal) are always known
import sys
from contextlib import contextmanager
from types import ModuleType
from typing import Any, BinaryIO

import numpy as np
import torch

MEGATRON_PREFIX = "megatron."


class UnsafePickle(pickle.UnpicklingError):
    """The file pickles globals outside the allowed set, or uses allowed ones in a way data never needs
    (``how``); ``names`` lists them."""

    def __init__(self, path: str, names: list[str], how: str = "") -> None:
        self.names, self.how = names, how
        super().__init__(f"{path} pickles objects outside what Slipway reads safely: {', '.join(names)}"
                         + (f" ({how})" if how else ""))


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


def stdlib_enum(qualname: str) -> type[enum.Enum] | None:
    """The enum class ``qualname`` names if it is a standard-library enum with members, of an already
    imported module (``signal.Signals``); None otherwise (a base to derive enums from, such as
    ``enum.Enum``, has none: called with names it makes a class). Imports nothing."""
    module_name, _, name = qualname.rpartition(".")
    if not module_name or module_name.split(".")[0] not in sys.stdlib_module_names:
        return None
    module = sys.modules.get(module_name)
    found = getattr(module, name, None) if isinstance(module, ModuleType) else None
    if isinstance(found, type) and issubclass(found, enum.Enum) and len(found.__members__) > 0:
        return found
    return None


def _by_value(cls: type[enum.Enum]):
    """What the file gets for an allowed enum's name: a lookup of one member by its value (how an enum
    member pickles: ``Signals(15)``), and nothing the unpickler would let it ``BUILD`` into."""
    def member(value: Any) -> enum.Enum:
        return cls(value)

    member.__qualname__ = f"{cls.__module__}.{cls.__qualname__}"
    return member


def _numpy_globals() -> list:
    """The numpy pieces an RNG state needs; plain data."""
    core = getattr(np, "_core", None) or np.core
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        allowed += [getattr(dtypes, n) for n in dir(dtypes) if n.endswith("DType")]
    return allowed


@contextmanager
def allowed(names: list[str] = ()):  # type: ignore[assignment]
    """``torch.load(weights_only=True)`` also accepts Namespace, numpy RNG states, the named Megatron
    globals (as stand-ins) and the named standard-library enums inside this block."""
    extra: list = [argparse.Namespace, *_numpy_globals()]
    for n in names:
        found = stdlib_enum(n)
        extra.append((_by_value(found), n) if found is not None else (stand_in(n), n))
    with torch.serialization.safe_globals(extra):
        yield


def readable(names: list[str]) -> tuple[list[str], list[str]]:
    """(the globals :func:`allowed` can stand in for or admit, the refused rest) of a file's globals."""
    base = {"argparse.Namespace"} | {f"{g.__module__}.{g.__qualname__}" for g in _numpy_globals()}
    ok = [n for n in names if n.startswith(MEGATRON_PREFIX) or stdlib_enum(n) is not None]
    return ok, [n for n in names if n not in ok and n not in base]


def load(path: str | BinaryIO, *, mmap: bool = True, where: str | None = None) -> Any:
    """``torch.load`` of a Slipway or Megatron-LM file (a path, or an open binary file such as a torch_dist
    object's bytes) with only the allowed globals (module docstring).

    Raises :class:`UnsafePickle` for any other global, ``RuntimeError``/``OSError`` for unreadable files.
    """
    mmap = mmap and isinstance(path, str)
    try:
        with allowed():
            return torch.load(_rewind(path), map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:
        pass  # a global outside the default set: look at which ones the file names
    names = torch.serialization.get_unsafe_globals_in_checkpoint(_rewind(path))
    ok, refused = readable(names)
    if refused:
        raise UnsafePickle(where or str(path), refused)
    try:
        with allowed(ok):
            return torch.load(_rewind(path), map_location="cpu", weights_only=True, mmap=mmap)
    except (pickle.UnpicklingError, TypeError) as err:  # an allowed global used as data never is
        raise UnsafePickle(where or str(path), ok, _cause(err)) from None


def _cause(err: Exception) -> str:
    """The unpickler's own words from torch's wrapped weights-only error (its first lines are advice to
    load with ``weights_only=False``, which this module exists not to do)."""
    text = str(err)
    _, found, after = text.partition("WeightsUnpickler error:")
    lines = [line.strip() for line in (after if found else text).splitlines() if line.strip()]
    return lines[0][:300] if lines else type(err).__name__


def _rewind(f: str | BinaryIO) -> str | BinaryIO:
    if not isinstance(f, str):
        f.seek(0)
    return f


SAFE_KINDS = ("plain data, tensors, argparse.Namespace, numpy RNG states, standard-library enums and "
              "Megatron's own classes")


def refusal(path: str, names: list[str], how: str = "") -> str:
    """What to tell a user whose file pickles ``names`` (refused by :func:`load`; ``how``: what it does
    with them that data never needs): what is read without running code, and the way that works:
    ``--trust-pickle`` with the modules the file names importable (Megatron's excepted: they stay
    stand-ins)."""
    modules = sorted({n.rpartition(".")[0] for n in names})
    used = f" ({how})" if how else ""
    return (f"{path} pickles {', '.join(names)}{used}, beyond what Slipway reads without running code from "
            f"the file ({SAFE_KINDS}). If you trust where the checkpoint came from, pass --trust-pickle: it "
            f"unpickles them by importing {', '.join(modules)}, which must then be importable (pip install "
            "the package that provides it, or put its source tree on PYTHONPATH); Megatron's own classes "
            "still need no Megatron install")


class _TrustingUnpickler(pickle.Unpickler):
    """A full unpickle (code named by the file runs), except that Megatron's classes become the inert
    stand-ins, so that ``--trust-pickle`` needs no Megatron install."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "megatron" or module.startswith(MEGATRON_PREFIX):
            return stand_in(f"{module}.{name}")
        return super().find_class(module, name)


_trusting = ModuleType("slipway_trusting_pickle")
_trusting.__dict__.update({k: getattr(pickle, k) for k in ("load", "loads", "dump", "dumps",
                                                            "Pickler", "UnpicklingError")})
_trusting.Unpickler = _TrustingUnpickler


def load_trusted(path: str | BinaryIO) -> Any:
    """``torch.load(weights_only=False)``: runs code the file names (only for files the user trusts); the
    modules it names must be importable, except Megatron's (stand-ins)."""
    return torch.load(path, map_location="cpu", weights_only=False, mmap=isinstance(path, str),
                      pickle_module=_trusting)
