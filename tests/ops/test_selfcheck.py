"""The start-up kernel self-check (trainer/ops/selfcheck.py) on its own: no false alarm on the real kernels
at real model widths, every kind of wrong kernel caught for every op, the run's RNG untouched, and ranks
agreeing on what falls back. Run-level behaviour (losses, records, exit): tests/train/test_kernel_check.py.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.ops.helpers import DEVICES
from tests.seam import hook_env
from tests.seam_kernels import KINDS, inject, parse
from tests.train.harness import spawn
from trainer import extension as _ext
from trainer.config import ModelConfig
from trainer.faults import KERNEL_FAULT
from trainer.ops import OPS, reference, resolve
from trainer.ops.selfcheck import CheckSetup, KernelCheckError, fail_message, run_check, with_eager
from trainer.ops.selfcheck_cases import CheckShapes

pytestmark = pytest.mark.skipif(not _ext.load(),
                                reason="trainer._C not built (tests/ops/test_dispatch.py fails)")

SMOKE = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128, vocab_size=8192)
CODEPARROT = ModelConfig(vocab_size=32768)  # CodeParrot-small: h 768, 12 heads, seq 1024
LLAMA = ModelConfig(num_layers=2, hidden_size=96, num_attention_heads=6, num_query_groups=2, seq_length=64,
                    vocab_size=300, position_embedding="rope", normalization="rmsnorm", activation="swiglu",
                    rotary_percent=0.5)
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _setup(model: ModelConfig, device: str = "cpu", dtypes=(F32,), params=F32, tp: int = 1) -> CheckSetup:
    return CheckSetup(torch.device(device), dtypes, params,
                      CheckShapes.for_model(model, tp, model.padded_vocab_size(tp)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model,tp", [(SMOKE, 2), (CODEPARROT, 1), (LLAMA, 2)],
                         ids=["smoke", "codeparrot", "llama"])
@pytest.mark.parametrize("dtypes,params", [((F32,), F32), ((BF16, F32), F32), ((F16, F32), F32),
                                           ((BF16,), BF16)], ids=["fp32", "bf16", "fp16", "bf16-params"])
def test_real_kernels_pass_at_model_widths(device, model, tp, dtypes, params):
    """No false alarm: every csrc op agrees with its reference within the stated tolerance, forward and
    backward, at the widths each model's layers hand the kernels."""
    check = run_check(resolve("csrc", device), _setup(model, device, dtypes, params, tp), "fallback")
    assert [r.op for r in check.results] == list(OPS)
    assert check.fallbacks == [], [r.describe() for r in check.results if not r.ok]
    assert all(r.ratio <= 0.5 for r in check.results), [(r.op, r.ratio) for r in check.results]  # margin
    assert check.kernels.names == resolve("csrc", device).names


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", OPS)
def test_each_wrong_op_is_caught_and_replaced_by_its_reference(op, kind):
    """A wrong output, a wrong gradient or a raising kernel, for every op: only that op fails, with its
    error and tolerance, and the checked set holds the eager reference for it."""
    kernels = inject(resolve("csrc", "cpu"), {KERNEL_FAULT: f"{op}:{kind}"})
    assert kernels.names[op] == "csrc+fault"
    check = run_check(kernels, _setup(LLAMA, dtypes=(BF16, F32)), "fallback")
    assert check.fallbacks == [op]
    bad = next(r for r in check.results if r.op == op)
    if kind == "raise":
        assert math.isinf(bad.ratio) and "no kernel image" in bad.error
    else:
        assert bad.max_error > bad.tolerance > 0, bad
        assert op in bad.describe() and f"{bad.tolerance:.3g}" in bad.describe()
    assert getattr(check.kernels, op) is getattr(reference, op) and check.kernels.names[op] == "eager"
    assert all(getattr(check.kernels, o) is getattr(kernels, o) for o in OPS if o != op)


def test_eager_ops_are_not_checked_and_a_fault_on_eager_is():
    assert run_check(resolve("eager", "cpu"), _setup(SMOKE), "fallback").results == []
    faulty = inject(resolve("eager", "cpu"), {KERNEL_FAULT: "layer_norm"})
    check = run_check(faulty, _setup(SMOKE), "fallback")
    assert [r.op for r in check.results] == ["layer_norm"] and check.fallbacks == ["layer_norm"]
    assert check.kernels == resolve("eager", "cpu")


def test_off_checks_nothing_and_fail_leaves_the_set_for_the_caller_to_refuse():
    faulty = inject(resolve("csrc", "cpu"), {KERNEL_FAULT: "swiglu"})
    off = run_check(faulty, _setup(LLAMA), "off")
    assert off.results == [] and off.kernels is faulty
    fail = run_check(faulty, _setup(LLAMA), "fail")
    assert fail.fallbacks == ["swiglu"] and fail.kernels is faulty
    message = fail_message(fail)
    assert "swiglu (csrc+fault)" in message and "Fix:" in message
    assert issubclass(KernelCheckError, ValueError)  # trainer.signals: permanent, not retried


def test_the_check_leaves_the_global_rng_untouched():
    """A checked run draws the same random numbers as an unchecked one (dropout, data order)."""
    torch.manual_seed(7)
    before = torch.get_rng_state()
    run_check(resolve("csrc", "cpu"), _setup(SMOKE, dtypes=(BF16, F32)), "fallback")
    assert torch.equal(before, torch.get_rng_state())


def test_hook_values_are_parsed_or_refused():
    assert parse("bias_gelu, rotary:grad") == {"bias_gelu": "value", "rotary": "grad"}
    assert parse("all:raise") == dict.fromkeys(OPS, "raise")
    assert parse("") == {}
    for bad in ("gelu", "bias_gelu:sometimes"):
        with pytest.raises(ValueError, match=KERNEL_FAULT):
            parse(bad)


def test_with_eager_swaps_only_the_named_ops():
    csrc = resolve("csrc", "cpu")
    out = with_eager(csrc, ["rotary", "cross_entropy"])
    assert out.rotary is reference.rotary and out.cross_entropy is reference.cross_entropy
    assert out.layer_norm is csrc.layer_norm and out.names["layer_norm"] == "csrc"


def _agree_worker(rank: int, out_dir: str) -> None:
    import json
    import os

    environ = {KERNEL_FAULT: "bias_gelu"} if rank == 1 else {}  # a kernel broken on one node only
    check = run_check(inject(resolve("csrc", "cpu"), environ), _setup(SMOKE), "fallback")
    bad = [r for r in check.results if not r.ok]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"fallbacks": check.fallbacks, "rank": [r.rank for r in bad],
                   "uses_reference": check.kernels.bias_gelu is reference.bias_gelu}, f)


def test_ranks_agree_an_op_broken_on_one_rank_falls_back_on_all(tmp_path):
    """Replicated parameters must see the same kernel everywhere: rank 0, whose kernel is fine, falls back
    too and names rank 1 as where the error was."""
    import json

    spawn(2, str(tmp_path), _agree_worker, str(tmp_path))
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == {"fallbacks": ["bias_gelu"], "rank": [1], "uses_reference": True}, (rank, got)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["auto", "compile"])
def test_cuda_auto_and_compile_sets_pass_at_codeparrot_widths(mode):
    """On the GPU, kernels=auto (apex where importable, else csrc) and torch.compile's kernels agree with
    eager at CodeParrot-small's widths in bf16 (both activation dtypes)."""
    check = run_check(resolve(mode, "cuda"), _setup(CODEPARROT, "cuda", (BF16, F32), F32), "fallback")
    assert check.results and check.fallbacks == [], [r.describe() for r in check.results if not r.ok]


def test_the_cli_exits_78_naming_the_failing_op(capsys, monkeypatch):
    """python -m trainer.ops.selfcheck: a site image's CI (exit 78, the JSON verdict on stdout)."""
    from trainer.ops.selfcheck import main

    assert main(["--kernels", "csrc", "--device", "cpu", "--precision", "fp32", "model.hidden_size=64",
                 "model.num_attention_heads=4", "model.seq_length=32"]) == 0
    assert json.loads(capsys.readouterr().out)["fallbacks"] == []
    for name, value in hook_env(KERNEL_FAULT="rms_norm").items():
        monkeypatch.setenv(name, value)
    assert main(["--kernels", "csrc", "--device", "cpu", "--precision", "bf16",
                 "model.normalization=rmsnorm", "model.rotary_percent=0.5"]) == 78
    out = capsys.readouterr()
    assert [f["op"] for f in json.loads(out.out)["fallbacks"]] == ["rms_norm"]
    assert "rms_norm (csrc+fault)" in out.err
