"""The dispatch: the extension is built and chosen (so the eager fallback cannot hide a broken build),
each mode resolves as documented, and torch.compile traces the csrc ops without graph breaks."""

from __future__ import annotations

import pytest
import torch

import trainer.ops as ops_mod
from tests.logs import LogLines
from trainer import extension as _ext
from trainer.ops import KERNEL_MODES, OPS, apex_impl, csrc_available, reference, resolve

EAGER = dict.fromkeys(OPS, "eager")
CSRC = dict.fromkeys(OPS, "csrc")
COMPILE = {**dict.fromkeys(OPS, "compile"), "adamw_step": "eager"}  # the optimizer loop stays eager
APEX = {"layer_norm": "apex", "scaled_causal_softmax": "apex"}  # the two ops apex has kernels for
# The compiled ops' Python faces, taken once here (while the real extension state holds: some tests below
# simulate a missing extension, under which trainer.ops.fused cannot be imported).
CSRC_FNS = ops_mod._csrc_table() if _ext.load() else {}


def _impl(ks, op: str) -> str:
    """Which implementation ``ks.<op>`` is, told from the callable itself (not from ``ks.names``)."""
    fn, ref = getattr(ks, op), getattr(reference, op)
    if fn is ref:
        return "eager"
    if op in CSRC_FNS and fn is CSRC_FNS[op]:
        return "csrc"
    if getattr(fn, "_torchdynamo_orig_callable", None) is ref:
        return "compile"
    if getattr(fn, "__name__", "") in ("apex_layer_norm", "apex_softmax"):
        return "apex"
    return f"unknown: {fn!r}"


def _picked(mode: str, device_type: str) -> dict[str, str]:
    """The implementation per op, asserting that ``names`` (what is logged) tells the truth."""
    ks = resolve(mode, device_type)
    actual = {op: _impl(ks, op) for op in OPS}
    assert ks.names == actual, (mode, device_type)
    return actual


def _fake_apex(monkeypatch, present: bool) -> None:
    """apex importable (stand-in modules) or not, whatever this machine has installed."""
    def absent():
        raise ImportError("apex (simulated absent)")

    class _Softmax:
        @staticmethod
        def apply(scores, scale):
            raise AssertionError("not called on CPU tensors")

    def same(*a):
        raise AssertionError("not called on CPU tensors")

    monkeypatch.setattr(apex_impl, "_import_layer_norm", (lambda: (same, same)) if present else absent)
    monkeypatch.setattr(apex_impl, "_import_softmax", (lambda: _Softmax) if present else absent)


def test_extension_is_built_and_auto_picks_csrc_on_cpu():
    assert _ext.load(), f"trainer._C failed to load: {_ext._STATE.get('error')}. Run `make install`."
    assert csrc_available("cpu")
    assert _picked("auto", "cpu") == CSRC
    assert _picked("csrc", "cpu") == CSRC


# (mode, device, csrc has kernels for that device, apex importable) -> the implementation of every op.
# "cuda" here is the dispatch decision only (no tensor is made), so these run on any machine.
CASES = [
    ("auto", "cpu", True, False, CSRC),
    ("auto", "cpu", True, True, CSRC),  # auto takes apex on CUDA only
    ("csrc", "cpu", True, True, CSRC),
    ("apex", "cpu", True, False, CSRC),  # no apex: every op from csrc
    ("apex", "cpu", True, True, {**CSRC, **APEX}),
    ("eager", "cpu", True, True, EAGER),
    ("compile", "cpu", True, True, COMPILE),
    ("auto", "cuda", True, True, {**CSRC, **APEX}),
    ("auto", "cuda", True, False, CSRC),
    ("auto", "cuda", False, False, EAGER),  # extension built without CUDA kernels
    ("auto", "cuda", False, True, {**EAGER, **APEX}),
    ("csrc", "cuda", True, True, CSRC),  # csrc mode never takes apex
    ("csrc", "cuda", False, True, EAGER),
    ("apex", "cuda", False, True, {**EAGER, **APEX}),
    ("eager", "cuda", True, True, EAGER),
    ("compile", "cuda", True, True, COMPILE),
    ("compile_layer", "cpu", True, True, CSRC),  # outside the compiled layers: csrc, never apex
    ("compile_layer", "cuda", True, True, CSRC),
    ("compile_layer", "cuda", False, True, EAGER),
]


@pytest.mark.parametrize(("mode", "device_type", "kernels", "apex", "expected"), CASES,
                         ids=[f"{m}-{d}-{'csrc' if k else 'nocsrc'}-{'apex' if a else 'noapex'}"
                              for m, d, k, a, _ in CASES])
def test_each_setting_picks_exactly(monkeypatch, mode, device_type, kernels, apex, expected):
    assert _ext.load(), "trainer._C not built (test_extension_is_built_and_auto_picks_csrc_on_cpu fails)"
    monkeypatch.setattr(ops_mod, "csrc_available", lambda d: {"cpu": True, "cuda": kernels}[d])
    _fake_apex(monkeypatch, apex)
    assert _picked(mode, device_type) == expected


@pytest.mark.parametrize(("mode", "apex", "expected"), [
    ("auto", False, EAGER), ("csrc", False, EAGER), ("apex", False, EAGER), ("apex", True, {**EAGER, **APEX}),
    ("eager", False, EAGER), ("compile", False, COMPILE)])
def test_missing_extension_falls_back_to_eager(monkeypatch, mode, apex, expected):
    """What a machine without a built extension gets (the warning itself is logged by _ext.load)."""
    monkeypatch.setattr(_ext, "_STATE", {"ok": False, "error": "simulated"})
    _fake_apex(monkeypatch, apex)
    assert not csrc_available("cpu") and not csrc_available("cuda")
    assert _picked(mode, "cpu") == expected


def test_mode_errors():
    with pytest.raises(ValueError, match="kernels="):
        resolve("fastest", "cpu")
    with pytest.raises(ValueError, match="device_type"):
        resolve("auto", "tpu")
    assert set(KERNEL_MODES) == {"auto", "csrc", "apex", "eager", "compile", "compile_layer"}
    assert resolve("compile_layer", "cpu").compile_layers and not resolve("compile", "cpu").compile_layers


def test_choice_is_logged_once():
    handler = LogLines()
    ops_mod.log.addHandler(handler)
    try:
        ops_mod._LOGGED.discard(("csrc", "cpu"))
        resolve("csrc", "cpu")
        resolve("csrc", "cpu")
    finally:
        ops_mod.log.removeHandler(handler)
    lines = [m for m in handler.lines if "kernels=csrc on cpu" in m]
    assert len(lines) == 1 and "bias_gelu=csrc" in lines[0] and "SDPA" in lines[0]


def _block(ks, x, w, b, bias, scores):
    h = ks.layer_norm(x, w, b, 1e-5)
    h = ks.bias_gelu(h, bias)
    h = ks.bias_dropout_add(h, bias, x, 0.1, True)
    return h.sum() + ks.scaled_causal_softmax(scores, 0.5).sum()


def test_torch_compile_traces_csrc_ops_without_graph_breaks():
    ks = resolve("csrc", "cpu")
    w, b = torch.ones(16), torch.zeros(16)
    results = []
    for compile_it in (True, False):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        bias = torch.randn(16, generator=torch.Generator().manual_seed(2), requires_grad=True)
        scores = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(3), requires_grad=True)
        fn = torch.compile(_block, fullgraph=True, backend="aot_eager") if compile_it else _block
        torch.manual_seed(0)  # the dropout seed is drawn from torch's generator, traced or not
        out = fn(ks, x, w, b, bias, scores)
        out.backward()
        results.append((out.detach(), x.grad, bias.grad, scores.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)
