"""Each op's schema is declared once (``TORCH_LIBRARY_FRAGMENT`` in csrc/ops.cpp and helpers.cpp); the CPU,
CUDA and Autograd blocks only ``m.impl`` names from that declaration, so the device builds cannot disagree
on an op's signature. Read from the sources: the CUDA file is checked even where it is not compiled."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "csrc"
_BLOCK = re.compile(r"TORCH_LIBRARY_(FRAGMENT|IMPL)\(slipway(?:,\s*(\w+))?,\s*m\)\s*\{(.*?)\n\}", re.S)
_DEF = re.compile(r'm\.def\(\s*"(\w+)\(')
_IMPL = re.compile(r'm\.impl\("(\w+)"')


def registrations(root: Path) -> tuple[dict[str, list[str]], dict[str, dict[str, list[str]]]]:
    """(op → files declaring its schema, dispatch key → op → files implementing it)."""
    defs: dict[str, list[str]] = {}
    impls: dict[str, dict[str, list[str]]] = {}
    for path in sorted([*root.glob("*.cpp"), *root.glob("cuda/*.cpp"), *root.glob("cuda/*.cu")]):
        for kind, key, body in _BLOCK.findall(path.read_text()):
            where = str(path.relative_to(root))
            if kind == "FRAGMENT":
                for op in _DEF.findall(body):
                    defs.setdefault(op, []).append(where)
            else:
                for op in _IMPL.findall(body):
                    impls.setdefault(key, {}).setdefault(op, []).append(where)
    return defs, impls


DEFS, IMPLS = registrations(CSRC)


def test_every_schema_is_declared_exactly_once():
    assert DEFS and {op: files for op, files in DEFS.items() if len(files) > 1} == {}


@pytest.mark.parametrize("key", ["CPU", "CUDA", "Autograd"])
def test_implementations_register_only_declared_ops_once(key):
    assert IMPLS.get(key), f"no {key} registrations found"
    assert set(IMPLS[key]) <= set(DEFS), set(IMPLS[key]) - set(DEFS)
    assert {op: f for op, f in IMPLS[key].items() if len(f) > 1} == {}


def test_cpu_and_cuda_implement_the_same_kernels():
    host_only = {"build_sample_idx"}  # the dataset index helper runs on the CPU by design
    assert set(IMPLS["CPU"]) == set(DEFS)
    assert set(IMPLS["CUDA"]) == set(DEFS) - host_only


def test_the_parser_sees_a_second_declaration(tmp_path: Path):
    (tmp_path / "a.cpp").write_text('TORCH_LIBRARY_FRAGMENT(slipway, m) {\n'
                                    '  m.def("f(Tensor x) -> Tensor");\n}\n')
    (tmp_path / "cuda").mkdir()
    (tmp_path / "cuda" / "b.cpp").write_text('TORCH_LIBRARY_FRAGMENT(slipway, m) {\n  m.def("f(Tensor y) -> '
                                             'Tensor");\n}\nTORCH_LIBRARY_IMPL(slipway, CUDA, m) {\n'
                                             '  m.impl("f", &f_cuda);\n}\n')
    defs, impls = registrations(tmp_path)
    assert defs == {"f": ["a.cpp", "cuda/b.cpp"]} and impls == {"CUDA": {"f": ["cuda/b.cpp"]}}
