"""``python -m orchestrator.docs``: write ``docs/config.md``, the configuration reference, from the schema,
and docs/cluster.md's examples of what the plan prints (orchestrator/docs_examples.py).

Keys, types and defaults come from the dataclasses of :mod:`orchestrator.base.schema`; each key's meaning from
the string literal right below its field (an attribute docstring: Python drops those at run time, so they
are read from the source with ``ast``); the value each shipped experiment gives a key from composing it
with Hydra as ``launch.py`` does (interpolations such as ``${oc.env:...}`` are shown unresolved, so the
file does not depend on the environment it was generated in).

    python -m orchestrator.docs            # (re)write docs/config.md and docs/cluster.md's examples
    python -m orchestrator.docs --check    # exit 1 when either is not current (what CI runs)

A schema field without a docstring is an error naming the field: every key users can set is documented.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator import docs_examples
from orchestrator.base import schema
from trainer.field_docs import class_field_docs

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "hydra_conf"
OUTPUT = REPO / "docs" / "config.md"
FIX = "python -m orchestrator.docs"
_ABSENT = object()  # a key inside a section that is null in an experiment (e.g. data.corpus)


@dataclass(frozen=True)
class FieldDoc:
    """One field as written in the source: its annotation and its attribute docstring."""

    annotation: str
    doc: str | None


@dataclass(frozen=True)
class ClassDoc:
    doc: str
    fields: dict[str, FieldDoc]


@dataclass(frozen=True)
class Row:
    key: str
    type: str
    default: str
    values: tuple[str, ...]  # one per experiment
    help: str


@dataclass(frozen=True)
class Section:
    path: str  # "" for the top level, else e.g. "logging.wandb"
    doc: str
    group: str  # the Hydra group line, or ""
    rows: tuple[Row, ...]


def attribute_docs(source: str) -> dict[str, ClassDoc]:
    """Per class of ``source``: its docstring and, per annotated field, the annotation and docstring."""
    out = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = {name: FieldDoc(*spelled) for name, spelled in class_field_docs(node).items()}
        out[node.name] = ClassDoc(" ".join((ast.get_docstring(node) or "").split()), fields)
    return out


def schema_docs(root: type) -> dict[str, ClassDoc]:
    """:func:`attribute_docs` of every module that defines a dataclass reachable from ``root`` or one of
    its bases (the trainer's sections live in trainer/config, the orchestrator's in schema.py)."""
    files = {inspect.getsourcefile(base) for cls in _dataclasses_under(root) for base in cls.__mro__
             if dataclasses.is_dataclass(base)}
    out: dict[str, ClassDoc] = {}
    for path in sorted(f for f in files if f):
        out.update(attribute_docs(Path(path).read_text(encoding="utf-8")))
    return out


def field_doc(cls: type, name: str, docs: dict[str, ClassDoc]) -> FieldDoc | None:
    """The field's source documentation, from the class in ``cls``'s MRO that declares it."""
    for base in cls.__mro__:
        fd = docs.get(base.__name__, ClassDoc("", {})).fields.get(name)
        if fd is not None:
            return fd
    return None


def missing_docs(root: type, docs: dict[str, ClassDoc]) -> list[str]:
    """``Class.field`` for every field reachable from ``root`` that has no docstring."""
    out = []
    for cls in _dataclasses_under(root):
        out += [f"{cls.__name__}.{f.name}" for f in dataclasses.fields(cls)
                if not (fd := field_doc(cls, f.name, docs)) or not fd.doc]
    return out


def _dataclasses_under(root: type) -> list[type]:
    seen = [root]
    for cls in seen:
        for f in dataclasses.fields(cls):
            sub = _nested(cls, f.name)
            if sub is not None and sub not in seen:
                seen.append(sub)
    return seen


def _nested(cls: type, name: str) -> type | None:
    """The dataclass type of field ``name`` (``X`` or ``X | None``), else None."""
    hint = typing.get_type_hints(cls)[name]
    for t in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(t):
            return t  # type: ignore[return-value]
    return None


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return _ABSENT


def fmt(value: Any) -> str:
    """A value as it would be written in YAML or on the command line."""
    if value is _ABSENT:
        return "—"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, list | tuple):
        return "`[" + ", ".join(_plain(v) for v in value) + "]`"
    if isinstance(value, dict):
        return "`{" + ", ".join(f"{k}: {_plain(v)}" for k, v in value.items()) + "}`"
    return f"`{_plain(value)}`"


def _plain(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    text = str(value)
    return '""' if text == "" else text


def _escape(text: str) -> str:
    """A table cell: pipes escaped."""
    return text.replace("|", "\\|")


def prose(text: str) -> str:
    """Docstring text as Markdown: RST ``code`` to `code`; <placeholders> outside code kept visible
    (a bare <run_dir> would be read as an HTML tag and vanish)."""
    parts = text.replace("``", "`").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def experiments() -> list[str]:
    return sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def composed(experiment: str) -> dict[str, Any]:
    """The config ``launch.py +experiment=<experiment>`` composes, as nested plain values (unresolved)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    schema.register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=[f"+experiment={experiment}"])
    return OmegaConf.to_container(cfg, resolve=False)  # type: ignore[return-value]


def _lookup(tree: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _ABSENT
        tree = tree[part]
    return tree


def _group_line(top: str) -> str:
    """The Hydra group that fills section ``top`` (``hydra_conf/<top>/``) and its options."""
    if top == "":
        options, pick = experiments(), "+experiment="
    else:
        options, pick = sorted(p.stem for p in (CONF / top).glob("*.yaml")), f"{top}="
    if not options:
        return ""
    where = f"hydra_conf/{top or 'experiment'}/"
    return f"Hydra group: `{pick}` " + ", ".join(f"`{o}`" for o in options) + f" (files in `{where}`)."


def collect(root: type, docs: dict[str, ClassDoc], trees: list[dict[str, Any]]) -> list[Section]:
    """One section per dataclass reachable from ``root``, in field order, leaf fields as rows."""
    out: list[Section] = []
    grouped: set[str] = set()

    def walk(cls: type, path: str) -> None:
        cdoc = docs[cls.__name__]
        rows, subs = [], []
        for f in dataclasses.fields(cls):
            key = f"{path}.{f.name}" if path else f.name
            sub = _nested(cls, f.name)
            if sub is not None:
                subs.append((sub, key))
                continue
            fd = field_doc(cls, f.name, docs)
            assert fd is not None  # missing_docs() has run
            values = tuple(fmt(_lookup(t, key)) for t in trees)
            rows.append(Row(key, fd.annotation, fmt(_default(f)), values, prose(str(fd.doc))))
        top = path.split(".")[0]
        if rows:
            group = "" if top in grouped else _group_line(top)
            grouped.add(top)
            out.append(Section(path, prose(cdoc.doc), group, tuple(rows)))
        for sub, key in subs:
            walk(sub, key)

    walk(root, "")
    return out


_HEADER = """\
# Configuration reference

<!-- Generated by `{fix}` from trainer/config/, orchestrator/base/schema.py, hydra_conf/; do not edit by hand.
     tests/orchestrator/test_docs.py fails when this file is not current. -->

Every key `python launch.py` accepts. Set keys on the command line (`optim.lr=3e-4`,
`data.paths=[/data/a.jsonl,/data/b.jsonl]`, `cluster.partition=null`), pick a file of a group
(`cluster=devcluster`, `+experiment=codeparrot`), or write your own group file (for example
`hydra_conf/cluster/mysite.yaml`, then `cluster=mysite`). A key that is not listed here, or a value of the
wrong type, stops the launch at composition as a problem with its fix (`[unknown_key] optim.lrr='3e-4': ...
Fix: did you mean optim.lr=3e-4?`, `[type] cluster.time_limit_min='48:00:00': must be an integer number of
minutes (48:00:00 = 2880)`).
Write keys without a leading `+` (which adds a key instead of setting one); `+` is for new entries of the
mappings `cluster.env` and `cluster.sbatch_extra` (`+cluster.env.NCCL_IB_HCA=mlx5_0`). Rules that involve
several keys (heads divisible by `tp_size`, the world size, memory, the time limit) are checked by the
plan, which lists every problem at once (see `dry_run=true`).

Columns: **default** is the schema's value (used when no group file sets the key); the next columns are the
values after composing `+experiment=NAME`, one per shipped experiment (`codeparrot` is the CodeParrot-small
run; `codeparrot_smoke` is the embedded pipeline that `make demo` runs). `${{oc.env:VAR,fallback}}` reads
an environment variable on the login node at launch; — means the enclosing section is `null` there.
"""


def render() -> str:
    """The whole of docs/config.md."""
    docs = schema_docs(schema.SlipwayConfig)
    missing = missing_docs(schema.SlipwayConfig, docs)
    if missing:
        raise ValueError(f"trainer/config, schema.py: no docstring for {', '.join(missing)}; add a string "
                         "literal on the line below each field saying what it means (its unit, what null "
                         f"means), then run {FIX}")
    names = experiments()
    sections = collect(schema.SlipwayConfig, docs, [composed(n) for n in names])
    lines = [_HEADER.format(fix=FIX)]
    lines.append("Sections: " + ", ".join(f"[`{s.path or 'top level'}`](#{_anchor(s)})" for s in sections))
    for s in sections:
        lines += ["", f"## {s.path or 'Top level'}", "", s.doc]
        if s.group:
            lines += ["", s.group]
        head = ["key", "type", "default", *names, "meaning"]
        lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in s.rows:
            cells = [f"`{r.key}`", f"`{r.type}`", r.default, *r.values, r.help]
            lines.append("| " + " | ".join(_escape(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _anchor(s: Section) -> str:
    return (s.path or "top level").replace(".", "").replace(" ", "-").lower()


def check(path: Path, text: str) -> str | None:
    """None when ``path`` holds ``text``; else what differs and the command that fixes it."""
    try:
        current = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return f"{path} does not exist; generate it with: {FIX}"
    if current == text:
        return None
    diff = list(difflib.unified_diff(current.splitlines(), text.splitlines(), str(path), "generated",
                                     lineterm="", n=0))
    shown = "\n".join(diff[:20]) + ("\n..." if len(diff) > 20 else "")
    return (f"{path} is not current with the config dataclasses, hydra_conf/ and the plan; regenerate it "
            f"with: {FIX} (and commit it)\n{shown}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.docs", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is not current")
    parser.add_argument("--output", type=Path, default=OUTPUT, help=f"default: {OUTPUT.relative_to(REPO)}")
    args = parser.parse_args(argv)
    pages = [(args.output, render())]
    if args.output == OUTPUT:  # the user docs' examples, with the reference (not for a copy elsewhere)
        pages.append((docs_examples.PAGE, docs_examples.render_page(docs_examples.PAGE.read_text("utf-8"))))
    if args.check:
        problems = [p for p in (check(path, text) for path, text in pages) if p]
        for problem in problems:
            sys.stderr.write(problem + "\n")
        if not problems:
            sys.stdout.write(" and ".join(str(path) for path, _ in pages) + " current\n")
        return 1 if problems else 0
    for path, text in pages:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        sys.stdout.write(f"wrote {path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
