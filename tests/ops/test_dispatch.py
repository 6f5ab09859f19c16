"""The dispatch: the extension is built and chosen (so the eager fallback cannot hide a broken build),
each mode resolves as documented, and torch.compile traces the csrc ops without graph breaks."""

from __future__ import annotations

import logging

import pytest
import torch

from trainer.ops import KERNEL_MODES, OPS, _ext, csrc_available, reference, resolve


def test_extension_is_built_and_auto_picks_csrc_on_cpu():
    assert _ext.load(), f"trainer._C failed to load: {_ext._STATE.get('error')}. Run `make install`."
    assert csrc_available("cpu")
    ks = resolve("auto", "cpu")
    assert ks.names == dict.fromkeys(OPS, "csrc")
    assert ks.bias_gelu is not reference.bias_gelu


def test_missing_extension_falls_back_to_eager(monkeypatch):
    """What a machine without a built extension gets (the warning itself is logged by _ext.load)."""
    monkeypatch.setattr(_ext, "_STATE", {"ok": False, "error": "simulated"})
    assert not csrc_available("cpu")
    assert resolve("csrc", "cpu").names == dict.fromkeys(OPS, "eager")
    assert resolve("auto", "cpu").names == dict.fromkeys(OPS, "eager")


def test_eager_mode_and_errors():
    ks = resolve("eager", "cpu")
    assert ks.names == dict.fromkeys(OPS, "eager") and ks.layer_norm is reference.layer_norm
    with pytest.raises(ValueError, match="kernels="):
        resolve("fastest", "cpu")
    with pytest.raises(ValueError, match="device_type"):
        resolve("auto", "tpu")
    assert set(KERNEL_MODES) == {"auto", "csrc", "apex", "eager", "compile"}


def test_compile_mode_wraps_the_references():
    ks = resolve("compile", "cpu")
    assert ks.names == {**dict.fromkeys(OPS, "compile"), "adamw_step": "eager"}
    assert ks.bias_gelu is not reference.bias_gelu and ks.adamw_step is reference.adamw_step


def test_apex_mode_without_apex_falls_back_to_csrc():
    ks = resolve("apex", "cpu")
    assert ks.names["layer_norm"] in ("csrc", "apex") and ks.names["bias_gelu"] == "csrc"


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_choice_is_logged_once():
    import trainer.ops as ops_mod

    handler = _Collect()
    ops_mod.log.addHandler(handler)
    try:
        ops_mod._LOGGED.discard(("csrc", "cpu"))
        resolve("csrc", "cpu")
        resolve("csrc", "cpu")
    finally:
        ops_mod.log.removeHandler(handler)
    lines = [m for m in handler.messages if "kernels=csrc on cpu" in m]
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
