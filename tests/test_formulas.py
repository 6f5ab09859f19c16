"""trainer.formulas: Megatron's FLOPs per iteration and vocabulary padding, defined once and used as-is by
the trainer's throughput log and the orchestrator's run-time estimate."""

from __future__ import annotations

import math

import pytest

from orchestrator.base import estimate
from orchestrator.base.layout import layout_of
from orchestrator.planning.plan import PlanInputs, make_plan
from tests.orchestrator.conftest import compose_cfg
from trainer import formulas, memory_formulas
from trainer.formulas import flops_per_iteration, padded_vocab_size
from trainer.time_formulas import fit_saturation, gemm_size, saturation

CP = ["+experiment=codeparrot"]


def test_flops_codeparrot_small_by_hand():
    # 72·B·s·l·h² · (1 + s/(6h) + V/(12·l·h)) with s/(6h) = 1024/4608 = 6/27, V/(12lh) = 32768/110592 = 8/27.
    by_hand = 72 * 192 * 1024 * 12 * 768**2 * 41 / 27
    assert by_hand == pytest.approx(152_144_921_493_504, rel=1e-15)  # ≈ 152 TFLOP per iteration
    assert padded_vocab_size(32768) == 32768
    assert flops_per_iteration(192, 1024, 12, 768, 32768) == pytest.approx(by_hand, rel=1e-12)


def test_flops_small_case_by_hand():
    # 72·4·16·2·32² = 9,437,184; 1 + 16/192 + 256/768 = 17/12.
    assert flops_per_iteration(4, 16, 2, 32, 256) == pytest.approx(13_369_344, rel=1e-12)
    # The vocabulary term is linear in V: 128 more rows add 72·B·s·l·h²·128/(12lh) = 6·B·s·h·128.
    extra = flops_per_iteration(4, 16, 2, 32, 384) - flops_per_iteration(4, 16, 2, 32, 256)
    assert extra == pytest.approx(6 * 4 * 16 * 32 * 128, rel=1e-12)


def test_padded_vocab_size():
    assert padded_vocab_size(50257, 1) == 50304
    assert padded_vocab_size(50257, 2) == 50432
    assert padded_vocab_size(300, 2, 128) == 512
    assert padded_vocab_size(32768, 1) == padded_vocab_size(32768, 8) == 32768
    assert padded_vocab_size(256, 1, 256) == 256


@pytest.mark.parametrize(("vocab", "tp", "padded"), [(32768, 1, 32768), (50257, 1, 50304), (50257, 2, 50432)])
def test_estimate_uses_the_formula_with_the_padded_vocab(vocab, tp, padded):
    cfg = compose_cfg(CP + [f"parallel.tp_size={tp}"])
    plan = make_plan(cfg, PlanInputs("r", "/runs/r", vocab_from_file=vocab), exists=lambda p: True)
    m = cfg.model
    assert (plan.layout.global_batch, m.seq_length, m.num_layers, m.hidden_size) == (192, 1024, 12, 768)
    assert padded_vocab_size(vocab, tp, m.make_vocab_size_divisible_by) == padded
    assert plan.time.flops_per_iter == flops_per_iteration(192, 1024, 12, 768, padded)
    if padded != vocab:  # the estimate once used the unpadded vocabulary
        assert plan.time.flops_per_iter != flops_per_iteration(192, 1024, 12, 768, vocab)


def test_estimate_follows_make_vocab_size_divisible_by():
    cfg = compose_cfg(CP + ["model.make_vocab_size_divisible_by=1024"])
    t = estimate.estimate_time(cfg, 50257, layout_of(cfg))
    assert t.flops_per_iter == flops_per_iteration(192, 1024, 12, 768, 51200)


def test_one_definition():
    """The copies are gone: the trainer's metrics and the estimate hold no FLOPs or padding formula."""
    metrics = pytest.importorskip("trainer.run.metrics")  # imports torch
    from trainer.convert import spec

    assert not hasattr(metrics, "flops_per_iteration")
    assert not hasattr(estimate, "flops_per_iteration") and not hasattr(estimate, "padded_vocab")
    assert not hasattr(spec, "padded_vocab")
    assert estimate.formulas is formulas


def test_activation_bytes_follow_korthikanti_table_2():
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B, the paper's example
    sbh = s * b * h
    per_layer = memory_formulas.activation_bytes_per_layer
    assert per_layer(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert per_layer(s, b, h, a, tp=8) == sbh * (10 + 24 / 8 + 5 * a * s / (h * 8))
    assert per_layer(s, b, h, a, 8, True) == sbh * (34 + 5 * a * s / h) / 8
    assert per_layer(s, b, h, a, 8, True, "selective") == 34 * sbh / 8
    assert per_layer(s, b, h, a, 8, False, "selective") == sbh * (10 + 24 / 8)
    assert per_layer(s, b, h, a, 8, True, "full") == 2 * sbh / 8
    full = per_layer(s, b, h, a, recompute="full")
    none = per_layer(s, b, h, a)
    stage = memory_formulas.stage_activation_bytes
    assert stage(8, s, b, h, a, granularity="full", recompute_layers=2) == 4 * full
    assert stage(8, s, b, h, a, granularity="full", method="block", recompute_layers=3) == 3 * full + 5 * none


@pytest.mark.parametrize("granularity", ["selective", "full"])
def test_the_plans_memory_follows_train_recompute(granularity):
    def activations(extra):
        cfg = compose_cfg(CP + extra)
        return estimate.estimate_memory(cfg, 32768, layout_of(cfg)).activations_bytes

    softmax = ["model.attention_backend=softmax"]
    assert activations([f"train.recompute_granularity={granularity}"] + softmax) < activations(softmax)


def test_selective_recompute_saves_nothing_with_flash_attention_on_gpu():
    """SDPA's flash/efficient kernels on CUDA already keep no s×s scores: selective changes nothing."""
    def activations(extra):
        cfg = compose_cfg(CP + ["model.attention_backend=sdpa"] + extra)
        assert cfg.cluster.gpus_per_node
        return estimate.estimate_memory(cfg, 32768, layout_of(cfg)).activations_bytes

    assert activations(["train.recompute_granularity=selective"]) == activations([])


def test_the_micro_batch_efficiency_rises_monotonically_and_saturates():
    """saturation(x, half) = x / (x + half): a half at ``half``, rising with the size, below 1, and 1 at an
    infinite size (a figure that means saturated); the size is tokens × hidden² / tp."""
    half = 2.6e9
    sizes = [half * 2.0**k for k in range(-8, 12)]
    shares = [saturation(x, half) for x in sizes]
    assert all(0 < a < b < 1 for a, b in zip(shares, shares[1:], strict=False))
    assert saturation(half, half) == 0.5 and saturation(math.inf, half) == 1.0
    assert 1 - shares[-1] < 1e-3 and shares[0] < 4e-3  # saturated above, a small share below
    assert gemm_size(8, 1024, 768) == 8 * 1024 * 768**2
    assert gemm_size(16, 1024, 768, tp=2) == gemm_size(8, 1024, 768)  # tp splits each product
    assert gemm_size(1, 2048, 2048) == gemm_size(1, 2048, 768) * (2048 / 768) ** 2


def test_the_fit_recovers_a_curve_and_is_a_least_squares_minimum():
    """Points on a known curve give it back; noisy points give the least-squares minimum (nudging either
    parameter adds squared error); fewer than two sizes cannot fix two parameters."""
    exact = [(x, 0.4 * saturation(x, 3e9)) for x in (1e9, 4e9, 1.6e10, 6.4e10)]
    top, half = fit_saturation(exact)
    assert top == pytest.approx(0.4, rel=1e-6) and half == pytest.approx(3e9, rel=1e-6)
    noisy = [(x, y * f) for (x, y), f in zip(exact, (1.03, 0.96, 1.01, 1.02), strict=True)]
    top, half = fit_saturation(noisy)

    def error(t: float, h: float) -> float:
        return sum((y - t * saturation(x, h)) ** 2 for x, y in noisy)

    for t, h in ((top * 1.01, half), (top * 0.99, half), (top, half * 1.02), (top, half * 0.98)):
        assert error(t, h) > error(top, half)
    with pytest.raises(ValueError, match="two or more positive sizes"):
        fit_saturation([(1e9, 0.2), (1e9, 0.21)])
