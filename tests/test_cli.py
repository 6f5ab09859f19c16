"""Command lines generated from config dataclasses (trainer/cli.py): every module that builds its flags
with ``add_dataclass_args`` is found in the source, and each of its dataclasses' fields must have its
flag, with the dataclass's default — so no command line keeps a default of its own."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from trainer.cli import Flags, add_dataclass_args, default_of, field_docs, from_args

REPO = Path(__file__).resolve().parents[1]


def cli_modules() -> list[str]:
    """Modules of trainer/ whose command line is generated (they declare FLAGS and build_parser)."""
    out = []
    for path in sorted((REPO / "trainer").rglob("*.py")):
        if path.name != "cli.py" and "add_dataclass_args(" in path.read_text(encoding="utf-8"):
            out.append(".".join(path.relative_to(REPO).with_suffix("").parts))
    return out


CLI_MODULES = cli_modules()


def test_the_generated_command_lines_are_found():
    assert {"trainer.eval.__main__", "trainer.data.preprocess", "trainer.data.train_tokenizer",
            "trainer.data.corpus", "trainer.convert.to_hf", "trainer.convert.from_hf"} <= set(CLI_MODULES)


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions}


def _required_argv(parser: argparse.ArgumentParser) -> list[str]:
    """A value for every required flag (parsing only, nothing is built from it)."""
    argv = []
    for a in parser._actions:
        if a.required and a.option_strings:
            argv += [a.option_strings[0], "x"]
    return argv


def check_flags(parser: argparse.ArgumentParser, flags: Flags) -> list[str]:
    """Every way ``parser`` disagrees with ``flags.cls``: a field without its flag, a skipped field with
    one, a default or a required-ness of the parser's own."""
    actions, problems = _actions(parser), []
    parsed = vars(parser.parse_args(_required_argv(parser)))
    for f in dataclasses.fields(flags.cls):
        action = actions.get(f.name)
        if f.name in flags.skip:
            problems += [f"{f.name}: skipped but has a flag"] if action is not None else []
            continue
        if action is None or flags.flag(f.name) not in action.option_strings:
            problems.append(f"{f.name}: no flag {flags.flag(f.name)}")
            continue
        default = default_of(f)
        if default is dataclasses.MISSING:
            problems += [] if action.required else [f"{f.name}: required in the dataclass, not on the CLI"]
        elif action.required or parsed[f.name] != default or action.default != default:
            problems.append(f"{f.name}: CLI default {parsed[f.name]!r}, dataclass default {default!r}")
    return problems


@pytest.mark.parametrize("module", CLI_MODULES)
def test_a_flag_per_field_with_the_dataclass_default(module):
    mod = importlib.import_module(module)
    parser = mod.build_parser()
    assert mod.FLAGS, module
    for flags in mod.FLAGS:
        assert check_flags(parser, flags) == [], f"{module}: {flags.cls.__name__}"


def test_the_check_catches_a_default_of_the_command_lines_own():
    from trainer.eval import __main__ as cli

    parser = cli.build_parser()
    parser.set_defaults(n_samples=100)  # what a hand-written --samples default=100 would be
    assert check_flags(parser, cli.FLAGS[1]) == ["n_samples: CLI default 100, dataclass default 200"]
    missing = dataclasses.replace(cli.FLAGS[1], skip=cli.FLAGS[1].skip - {"time_limit_min"})
    assert check_flags(cli.build_parser(), missing) == ["time_limit_min: no flag --time-limit-min"]


def test_megatron_spellings_of_preprocess():
    """bench/preprocess.py and the tests run Megatron's tools/preprocess_data.py command lines unchanged."""
    from trainer.data.preprocess import build_parser

    options = {s for a in build_parser()._actions for s in a.option_strings}
    assert {"--input", "--output-prefix", "--json-keys", "--tokenizer-type", "--vocab-file", "--merge-file",
            "--append-eod", "--workers", "--dataset-impl", "--chunk-size"} <= options


def test_the_older_eval_flags_build_the_same_config():
    from trainer.eval import __main__ as cli
    from trainer.eval.config import EvalConfig, EvalRun

    a = cli.build_parser().parse_args(["--hf-dir", "h", "--out", "o", "--problems", "2", "--samples", "4",
                                       "--pass-at-k", "1", "2", "--temperatures", "0.2", "0.6", "--jsonl",
                                       "a.jsonl", "--data-prefix", "p", "--allow-code-execution"])
    settings = from_args(cli.FLAGS[1], a, enabled=True)
    assert settings == EvalConfig(enabled=True, humaneval_problems=2, n_samples=4, pass_at_k=[1, 2],
                                  temperatures=[0.2, 0.6], perplexity_files=["a.jsonl"],
                                  allow_code_execution=True)
    assert from_args(cli.FLAGS[0], a, settings=settings) == EvalRun("h", "o", settings, heldout_prefix="p")
    defaults = cli.build_parser().parse_args(["--hf-dir", "h", "--out", "o"])
    assert from_args(cli.FLAGS[1], defaults) == EvalConfig()


# --- the helper on its own ---

@dataclass
class _Example:
    path: Path  # where it goes
    names: list[str]
    """Documented below the field."""
    count: int | None = None
    ratio: float = 0.5
    on: bool = True
    off: bool = False
    extra: list[int] = field(default_factory=list)


def test_types_docs_and_renames():
    parser = argparse.ArgumentParser()
    flags = Flags(_Example, rename={"count": "n"})
    add_dataclass_args(parser, flags)
    a = parser.parse_args(["--path", "p", "--names", "a", "b", "--n", "3", "--no-on", "--off"])
    assert from_args(flags, a) == _Example(Path("p"), ["a", "b"], 3, 0.5, False, True, [])
    assert field_docs(_Example) == {"path": "where it goes", "names": "Documented below the field."}
    assert check_flags(parser, flags) == []


def test_a_field_without_a_command_line_form_must_be_skipped():
    @dataclass
    class Nested:
        inner: _Example
        size: int = 1

    with pytest.raises(TypeError, match="inner: .* skip the field"):
        add_dataclass_args(argparse.ArgumentParser(), Flags(Nested))
    add_dataclass_args(argparse.ArgumentParser(), Flags(Nested, skip=frozenset({"inner"})))
    with pytest.raises(ValueError, match=r"no field\(s\) \['sise'\]"):
        Flags(Nested, rename={"sise": "s"})
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, Flags(Nested, skip=frozenset({"inner"})))
    with pytest.raises(ValueError, match="already has a flag for 'size'"):  # two classes, one field name
        add_dataclass_args(parser, Flags(Nested, skip=frozenset({"inner"}), rename={"size": "other"}))
