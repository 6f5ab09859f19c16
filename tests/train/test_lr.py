"""LR schedule against Megatron's formulas (OptimizerParamScheduler), counted in samples."""

import math

import pytest
import torch

from trainer.config import OptimConfig
from trainer.optim.lr import LRSchedule, OptimizerParamScheduler, lr_at

MAX, MIN, WARM, DECAY, GBS = 6e-4, 6e-5, 10, 110, 8


def megatron_lr(samples: int, style: str) -> float:
    """Megatron's get_lr written out independently: warm-up, then decay over (decay - warm-up) samples."""
    warm, decay = WARM * GBS, DECAY * GBS
    if samples <= warm:
        return MAX * samples / warm
    if style == "constant":
        return MAX
    if samples > decay:
        return MIN
    ratio = (samples - warm) / (decay - warm)
    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0) if style == "cosine" else 1.0 - ratio
    return MIN + coeff * (MAX - MIN)


def scheduler(style: str, gbs: int = GBS, warm: int = WARM, decay: int = DECAY):
    p = torch.nn.Parameter(torch.zeros(2, 2))
    b = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([{"params": [p], "wd_mult": 1.0}, {"params": [b], "wd_mult": 0.0}], lr=1.0)
    cfg = OptimConfig(lr=MAX, min_lr=MIN, warmup_iters=warm, decay_iters=decay, decay_style=style,
                      weight_decay=0.1)
    return opt, OptimizerParamScheduler(opt, LRSchedule.from_iters(cfg, iters=200, global_batch_size=gbs))


@pytest.mark.parametrize("style", ["cosine", "linear", "constant"])
def test_schedule_matches_megatron(style):
    opt, sched = scheduler(style)
    # Megatron steps by 0 at construction: with warm-up the first update uses lr = 0.
    assert opt.param_groups[0]["lr"] == 0.0
    for it in range(1, 151):
        sched.step(GBS)  # after iteration `it`
        want = megatron_lr(it * GBS, style)
        assert opt.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12, abs=1e-18), (style, it)
        assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[1]["weight_decay"] == 0.0


def test_key_points():
    _, sched = scheduler("cosine")
    s = sched.schedule
    assert lr_at(s, 5 * GBS) == pytest.approx(MAX / 2)  # half-way through warm-up
    assert lr_at(s, WARM * GBS) == pytest.approx(MAX)  # end of warm-up
    mid = (WARM + DECAY) // 2 * GBS
    assert lr_at(s, mid) == pytest.approx((MAX + MIN) / 2)  # cosine at half decay: the mean
    assert lr_at(s, DECAY * GBS) == pytest.approx(MIN)  # end of decay
    assert lr_at(s, 10 * DECAY * GBS) == MIN  # after the end


def test_samples_keep_the_shape_when_batch_changes():
    # The schedule lives in samples: with twice the batch and half the iterations (the same samples),
    # every data position gets the same learning rate.
    _, a = scheduler("cosine", gbs=8)
    _, b = scheduler("cosine", gbs=16, warm=WARM // 2, decay=DECAY // 2)
    for it in range(0, 120, 7):
        assert lr_at(a.schedule, it * 2 * 8) == pytest.approx(lr_at(b.schedule, it * 16))


def test_state_dict_roundtrip_and_megatron_keys():
    _, a = scheduler("cosine")
    for _ in range(37):
        a.step(GBS)
    sd = a.state_dict()
    assert {"max_lr", "lr_warmup_steps", "num_steps", "lr_decay_style", "lr_decay_steps", "min_lr",
            "start_wd", "end_wd", "wd_incr_style", "wd_incr_steps"} <= set(sd)
    assert sd["num_steps"] == 37 * GBS
    opt, b = scheduler("cosine")
    b.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == a.get_lr() == megatron_lr(37 * GBS, "cosine")
