"""Command-line flags generated from a config dataclass, so a default or a type is written once: in the
dataclass. One flag per field, ``--field-name`` unless ``rename`` keeps a spelling users already type
(``--samples`` for ``n_samples``); the argparse ``dest`` is always the field name. Help is the field's
documentation as written in the class (the string after it, or the comment ending its line).

Types: ``bool`` (``store_true`` when the default is False, ``--x/--no-x`` when True), ``int``, ``float``,
``str``, ``Path``, each optionally ``| None``, and ``list[...]`` of those (``nargs="*"`` when the default
is empty, else ``"+"``). A field of another type must be skipped (the command sets it itself), else
building the parser raises, naming it.

A module whose command line uses this declares ``FLAGS`` (its :class:`Flags`, one per dataclass) and
``build_parser()``; tests/test_cli.py checks every such module: a flag per field, the dataclass's default.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import textwrap
import tokenize
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.field_docs import class_field_docs

_SCALARS = (int, float, str, Path)


@dataclass(frozen=True)
class Flags:
    """How one dataclass's fields become flags."""

    cls: type
    skip: frozenset[str] = frozenset()
    """Fields the command sets itself (or that mean nothing on a command line): no flag."""
    rename: Mapping[str, str] = field(default_factory=dict)
    """Field → flag spelling (without ``--``) where the command line's older spelling differs."""
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Field → more ``add_argument`` keywords (``choices``, ``action="append"``, ``metavar``)."""

    def __post_init__(self) -> None:
        names = {f.name for f in dataclasses.fields(self.cls)}
        unknown = sorted((set(self.skip) | set(self.rename) | set(self.options)) - names)
        if unknown:
            raise ValueError(f"{self.cls.__name__} has no field(s) {unknown}")

    def fields(self) -> list[dataclasses.Field]:
        """The fields that get a flag, in declaration order."""
        return [f for f in dataclasses.fields(self.cls) if f.name not in self.skip]

    def flag(self, name: str) -> str:
        """The flag of field ``name``, e.g. ``--samples``."""
        return "--" + self.rename.get(name, name.replace("_", "-"))


def default_of(f: dataclasses.Field) -> Any:
    """The field's default (a factory's value); ``dataclasses.MISSING`` when it has none."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def field_docs(cls: type) -> dict[str, str]:
    """Each field's documentation as written in the class body (and its dataclass bases): the string
    literal after it (the house style, which the config reference is rendered from) or else the comment
    ending its line."""
    out: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            out.update(_own_docs(base))
    return out


def _own_docs(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (built in a REPL): flags without help
        return {}
    comments = {t.start[0]: t.string.lstrip("#").strip()
                for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.ClassDef), cls
    return {name: doc for name, (_, doc) in class_field_docs(node, comments).items() if doc}


def _kind(hint: Any) -> tuple[Any, bool]:
    """(element type, is a list) of a field's type hint, ``| None`` removed."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else hint
    if typing.get_origin(hint) is list and len(typing.get_args(hint)) == 1:
        return typing.get_args(hint)[0], True
    return hint, False


def _argument(f: dataclasses.Field, hint: Any, doc: str | None) -> dict[str, Any]:
    """``add_argument`` keywords for one field."""
    default = default_of(f)
    required = default is dataclasses.MISSING
    # Help is plain text: no reST quotes, and argparse reads % as a format.
    kw: dict[str, Any] = {"dest": f.name, "help": doc.replace("``", "").replace("%", "%%") if doc else None}
    element, is_list = _kind(hint)
    if element is bool and not is_list:
        kw["action"] = argparse.BooleanOptionalAction if default else "store_true"
        kw["default"] = bool(default) if not required else False
        return kw
    if element not in _SCALARS:
        raise TypeError(f"{f.name}: {hint} has no command-line form; skip the field (Flags.skip)")
    kw["type"] = element
    if is_list:
        kw["nargs"] = "+" if required or default else "*"
    if required:
        kw["required"] = True
    else:
        kw["default"] = default
        if kw["help"] is not None and default not in (None, []):
            kw["help"] += " (default: %(default)s)"
    return kw


def add_dataclass_args(parser: argparse.ArgumentParser, flags: Flags) -> None:
    """One flag per field of ``flags.cls`` (except the skipped ones)."""
    hints = typing.get_type_hints(flags.cls)
    docs = field_docs(flags.cls)
    taken = {a.dest for a in parser._actions}  # argparse has no public list; a shared dest would be silent
    for f in flags.fields():
        if f.name in taken:  # two dataclasses of one command line may not share a field name
            raise ValueError(f"{flags.cls.__name__}.{f.name}: the parser already has a flag for {f.name!r}")
        kw = _argument(f, hints[f.name], docs.get(f.name))
        kw.update(flags.options.get(f.name, {}))
        if "type" in kw and "choices" not in kw and "metavar" not in kw:  # --samples SAMPLES, as typed
            kw["metavar"] = flags.flag(f.name).removeprefix("--").replace("-", "_").upper()
        if kw.get("action") == "append":
            kw.pop("nargs", None)
        parser.add_argument(flags.flag(f.name), **kw)


def from_args(flags: Flags, namespace: argparse.Namespace, **fixed: Any) -> Any:
    """An instance of ``flags.cls`` from the parsed flags; ``fixed`` gives the fields the command sets."""
    values = {f.name: getattr(namespace, f.name) for f in flags.fields()}
    return flags.cls(**values, **fixed)
