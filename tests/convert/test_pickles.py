"""The restricted reader of Megatron's pickles (trainer/checkpoint/pickles.py) on what core_v0.19 writes,
and the way out it offers for anything else.

- Standard-library enums are data: core_v0.19's ``args.exit_signal = signal.SIGTERM`` loads as the real
  ``signal.Signals`` member (looked up by value; nothing from the file runs); a standard-library global
  that is not an enum is refused — a function, and a class the file calls (``logging.FileHandler``
  opens a file when called) or makes with ``NEWOBJ``; an enum base that makes classes when called
  (``enum.Enum``) too; and a file that ``BUILD``s state into an enum member it looked up (members are
  process-wide: it would rename ``signal.SIGTERM`` for the whole process) is refused, the member intact.
- Megatron's classes and enums load as inert stand-ins by module and name, without Megatron installed.
- A refused file's message names the globals and ``--trust-pickle`` with the modules it would import; and
  that way works: ``--trust-pickle`` reads a file naming Megatron's classes without Megatron installed
  (before, it answered that the ``megatron`` package is needed and to load without --trust-pickle: a
  circle), and a module that really is missing is named with how to install it.
- A torch_dist ``.metadata`` naming anything torch never writes there is refused (torch's own reader
  unpickles it with a plain ``pickle.load``).
"""

from __future__ import annotations

import argparse
import collections
import enum
import logging
import os
import pickle
import signal
import sys
from pathlib import Path

import pytest
import torch

from trainer.checkpoint import pickles
from trainer.checkpoint.files import DIST_METADATA, CheckpointError
from trainer.convert.shard_io import load_shard


def _fake_megatron(root: Path) -> None:
    """A package ``megatron.core.enums`` with an enum and a dataclass, as Megatron pickles them."""
    pkg = root / "megatron" / "core"
    pkg.mkdir(parents=True)
    (root / "megatron" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "enums.py").write_text("import enum\nclass ModelType(enum.Enum):\n    encoder_or_decoder = 1\n")


@pytest.fixture
def megatron_file(tmp_path, monkeypatch):
    """A shard whose args hold signal.SIGTERM and Megatron's ModelType, saved where megatron was
    importable; afterwards megatron is gone again (as on a machine without it)."""
    _fake_megatron(tmp_path / "src")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    from megatron.core.enums import ModelType

    path = tmp_path / "model_optim_rng.pt"
    args = argparse.Namespace(exit_signal=signal.SIGTERM, model_type=ModelType.encoder_or_decoder,
                              num_layers=2)
    torch.save({"args": args, "model": {"w": torch.ones(2)}}, path)
    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path / "src")])
    return path


def test_standard_library_enums_and_megatrons_classes_load_as_data(megatron_file):
    shard = pickles.load(str(megatron_file))
    args = shard["args"]
    assert args.exit_signal is signal.SIGTERM  # the real member, by value
    assert isinstance(args.model_type, pickles.MegatronObject)
    assert args.model_type.qualname == "megatron.core.enums.ModelType" and args.model_type.value == 1
    assert "megatron" not in sys.modules  # nothing of Megatron was imported


def test_trust_pickle_needs_no_megatron_install(megatron_file):
    shard = load_shard(megatron_file, trust_pickle=True)
    assert shard["args"].exit_signal is signal.SIGTERM
    assert shard["args"].model_type.qualname == "megatron.core.enums.ModelType"


def test_a_standard_library_global_that_is_not_an_enum_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"args": argparse.Namespace(x=os.system)}, path)  # a callable: would run on a full load
    with pytest.raises(pickles.UnsafePickle, match=r"posix\.system|os\.system"):
        pickles.load(str(path))


class _Calls:
    """Pickles as a call of ``func(*args)`` (REDUCE), with ``state`` then BUILT into the result."""

    def __init__(self, func, *args, state=None):
        self.func, self.args, self.state = func, args, state

    def __reduce__(self):
        return (self.func, self.args) if self.state is None else (self.func, self.args, self.state)


def _saved(tmp_path, value) -> str:
    path = tmp_path / "crafted.pt"
    torch.save({"args": argparse.Namespace(x=value)}, path)
    return str(path)


@pytest.mark.parametrize("how", ["call", "newobj"])
def test_a_standard_library_class_is_refused_and_never_runs(tmp_path, how):
    """A crafted checkpoint that calls logging.FileHandler(path) on load would create that file."""
    target = tmp_path / "created_by_the_checkpoint.log"
    # NEWOBJ: an instance made without __init__ pickles as cls.__new__(cls)
    crafted = (_Calls(logging.FileHandler, str(target)) if how == "call"
               else logging.FileHandler.__new__(logging.FileHandler))
    with pytest.raises(pickles.UnsafePickle, match=r"logging\.FileHandler"):
        pickles.load(_saved(tmp_path, crafted))
    assert not target.exists()


def test_the_classes_data_needs_load(tmp_path):
    """What a real checkpoint holds still loads: an OrderedDict (torch's own list), a standard-library
    enum's member by value, by either opcode."""
    value = [collections.OrderedDict(a=1), signal.SIGTERM, _Calls(signal.Signals, 2)]
    loaded = pickles.load(_saved(tmp_path, value))["args"].x
    assert loaded == [collections.OrderedDict(a=1), signal.SIGTERM, signal.SIGINT]
    assert type(loaded[0]) is collections.OrderedDict and loaded[1] is signal.SIGTERM


def test_an_enum_base_that_makes_classes_is_refused(tmp_path):
    with pytest.raises(pickles.UnsafePickle, match=r"enum\.Enum"):
        pickles.load(_saved(tmp_path, _Calls(enum.Enum, "Made", "a b")))


def test_state_built_into_a_standard_library_enum_member_is_refused(tmp_path):
    crafted = _Calls(signal.Signals, 15, state={"_name_": "SIGKILL"})
    try:
        with pytest.raises(pickles.UnsafePickle, match=r"signal\.Signals.*build"):
            pickles.load(_saved(tmp_path, crafted))
    finally:
        renamed = signal.SIGTERM.name
        signal.SIGTERM._name_ = "SIGTERM"  # repair the process if the load went through
    assert renamed == "SIGTERM"


def test_the_refusal_offers_trust_pickle_with_the_module_and_that_way_works(tmp_path):
    src = tmp_path / "src"
    (src / "thirdparty").mkdir(parents=True)
    (src / "thirdparty" / "__init__.py").write_text("class Config:\n    pass\n")
    sys.path.insert(0, str(src))
    try:
        import thirdparty

        path = tmp_path / "shard.pt"
        torch.save({"args": argparse.Namespace(config=thirdparty.Config())}, path)
        refusal = r"thirdparty\.Config.*--trust-pickle.*importing thirdparty"
        with pytest.raises(CheckpointError, match=refusal):
            load_shard(path)
        assert isinstance(load_shard(path, trust_pickle=True)["args"].config, thirdparty.Config)
    finally:
        sys.path.remove(str(src))
        sys.modules.pop("thirdparty", None)
    with pytest.raises(CheckpointError, match=r"'thirdparty'.*install the package.*--trust-pickle"):
        load_shard(path, trust_pickle=True)  # the module is gone: the message says how to get it


def test_the_trainer_refuses_and_points_at_the_converters(tmp_path):
    from trainer.checkpoint.protocol import load_file

    path = tmp_path / "shard.pt"
    torch.save({"args": argparse.Namespace(x=os.system)}, path)
    with pytest.raises(CheckpointError, match="never runs code.*to_hf --trust-pickle.*from_hf"):
        load_file(str(path))


class _Evil:
    def __reduce__(self):
        return (os.system, ("true",))


def test_a_torch_dist_metadata_naming_other_code_is_refused(tmp_path):
    from trainer.checkpoint import dist_read

    (tmp_path / DIST_METADATA).write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(CheckpointError, match="never holds: refused"):
        dist_read.read_metadata(tmp_path)
