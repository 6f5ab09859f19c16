"""The plan's step-time model and memory headroom (issue 52 item 5), each term alone against its formula by
hand: the tensor-parallel all-reduces at the node's bandwidth from the device table, the pipeline bubble,
the slowest stage pacing the pipeline, the stage-to-stage transfers, the data-parallel exchange inside a
node; and one headroom rule for the memory check and layout=auto. CodeParrot-small (12 layers, h 768,
seq 1024, global batch 192) on docs/cluster.md's walkthrough site (nodes of 4 H100 SXM)."""

from __future__ import annotations

import pytest

from orchestrator.base.estimate import GIB, stage_balance
from orchestrator.base.measured import efficiency_curves
from orchestrator.planning.plan import PlanInputs, make_plan
from orchestrator.planning.plan_format import format_plan
from tests.orchestrator.conftest import compose_cfg
from tests.orchestrator.sites import H100_X4, site_file
from trainer import formulas
from trainer.time_formulas import gemm_size, saturation

KEY = {"WANDB_API_KEY": "k" * 40}
CP = ["+experiment=codeparrot"]
FAST = "bus_bandwidth_gbps: 1.0e9\nintra_node_bandwidth_gbps: 1.0e9\n"  # no transfer waits


def _plan(overrides):
    cfg = compose_cfg(overrides)
    return cfg, make_plan(cfg, PlanInputs("r", "/runs/r", environ=KEY), exists=lambda p: True)


@pytest.fixture
def h100(tmp_path):
    return site_file(tmp_path, "mysite", H100_X4)


def test_tensor_parallel_all_reduces_at_the_nodes_bandwidth_by_hand(h100, tmp_path):
    """Per layer and micro-batch two all-reduces forward and two backward of b·s·h 16-bit activations,
    a ring's 2(t − 1)/t of them each, at half the device table's 900 GB/s NVLink (Megatron, Narayanan et
    al. 2021 §3.3.1: 8·b·s·h·(t − 1)/t per layer)."""
    cfg, plan = _plan([*CP, *h100, "parallel.tp_size=2", "train.micro_batch_size=8"])
    m, b, s, h, layers, t = 192 // (8 * 4), 8, 1024, 768, 12, 2
    by_hand = m * layers * 8 * b * s * h * (t - 1) / t * 2 / 450e9
    assert plan.time.tp_comm_s == pytest.approx(by_hand)
    assert "within a node     450 GB/s" in format_plan(cfg, plan, {})
    assert f"tensor-parallel all-reduces {by_hand:.3g} s (at 450 GB/s)" in format_plan(cfg, plan, {})
    # The site's own figure wins; fp32 moves twice the bytes; full recomputation repeats the forward's two.
    site = site_file(tmp_path, "nv", H100_X4 + "intra_node_bandwidth_gbps: 900\n")
    _, fast = _plan([*CP, *site, "parallel.tp_size=2", "train.micro_batch_size=8"])
    assert fast.time.tp_comm_s == pytest.approx(by_hand / 2)
    _, fp32 = _plan([*CP, *h100, "parallel.tp_size=2", "train.micro_batch_size=8", "train.precision=fp32"])
    assert fp32.time.tp_comm_s == pytest.approx(2 * by_hand)
    _, full = _plan([*CP, *h100, "parallel.tp_size=2", "train.micro_batch_size=8",
                     "train.recompute_granularity=full"])
    assert full.time.tp_comm_s == pytest.approx(1.5 * by_hand)
    _, tp1 = _plan([*CP, *h100, "train.micro_batch_size=8"])
    assert tp1.time.tp_comm_s == 0


def test_tp1_tp2_and_tp4_no_longer_tie(h100):
    """The issue's example: the best layout of each tensor-parallel size had the same estimate (0.07044 s);
    with the all-reduces the larger groups cost more, and three of four trials were tp2/tp4 layouts."""
    _, plan = _plan([*CP, *h100, "layout=auto", "tune=true"])
    best = {}
    for r in plan.proposal.ranked:
        best.setdefault(r.candidate.tp, r.time.step_s)
    assert best[1] < best[2] < best[4], best
    assert [r.candidate.tp for r in plan.proposal.trials(4)].count(1) >= 3


def test_the_bubble_stretches_a_pipelined_step_by_p_minus_1_over_m(tmp_path):
    """1F1B with p stages and m micro-batches: the step is (1 + (p − 1)/m) times the work of its stage
    (performance.md); the same global batch in 6 or 12 micro-batches differs by that factor alone."""
    site = site_file(tmp_path, "fast", H100_X4 + FAST)
    pp2 = [*CP, *site, "parallel.pp_size=2", "cluster.gpus=4"]  # dp 2
    _, six = _plan([*pp2, "train.micro_batch_size=16"])
    _, twelve = _plan([*pp2, "train.micro_batch_size=8"])
    assert (six.time.bubble_fraction, twelve.time.bubble_fraction) == (1 / 6, 1 / 12)
    ratio = six.time.step_s / twelve.time.step_s
    # The larger micro-batch computes at a higher MFU (its own test below): that factor aside, the bubble's.
    mfu = twelve.time.mfu / six.time.mfu
    assert mfu < 1 and ratio == pytest.approx((1 + 1 / 6) / (1 + 1 / 12) * mfu, rel=1e-6)


def test_the_busiest_stage_paces_the_pipeline(tmp_path):
    """Two even stages hold 6 layers each, and the last the logits too: the step is 2 × that stage's
    share of the FLOPs longer than a balanced pipeline; moving a layer off the last stage shortens it."""
    site = site_file(tmp_path, "fast", H100_X4 + FAST)
    cfg, even = _plan([*CP, *site, "parallel.pp_size=2", "cluster.gpus=4", "train.micro_batch_size=1"])
    body = formulas.model_flops_per_iteration(cfg.model, 1, 0)
    head = formulas.model_flops_per_iteration(cfg.model, 1, 32768) - body
    assert stage_balance(cfg, 32768) == pytest.approx(2 * (body / 2 + head) / (body + head))
    _, flat = _plan([*CP, *site, "cluster.gpus=4", "train.micro_batch_size=12"])  # the same 4 GPUs, dp 4
    mfu = flat.time.mfu / even.time.mfu  # micro-batch 1 computes at a lower MFU than 12
    balanced = flat.time.step_s * mfu
    assert even.time.step_s / (1 + 1 / 96) == pytest.approx(balanced * stage_balance(cfg, 32768))
    _, uneven = _plan([*CP, *site, "parallel.pp_size=2", "cluster.gpus=4", "train.micro_batch_size=1",
                       "parallel.first_stage_layers=7"])
    assert uneven.time.step_s < even.time.step_s


def test_the_mfu_follows_the_micro_batch_by_the_measured_curve(tmp_path):
    """The figure measured at micro-batch 64 (27.3 %, CodeParrot-small bf16 on one H200) holds there; a
    smaller micro-batch, or tensor parallelism splitting the same one, computes its matrix products at the
    curve's share of it, tokens × hidden² / tp deciding; a site's cluster.mfu means saturation; on CPUs,
    with no curve measured, every micro-batch runs at the MFU. The compute time follows the MFU alone."""
    (curve,) = efficiency_curves()
    h200 = site_file(tmp_path, "h200", H100_X4.replace("H100-80GB", "H200") + FAST)
    bf16 = [*CP, *h200, "train.precision=bf16"]
    _, at64 = _plan([*bf16, "train.global_batch_size=512", "train.micro_batch_size=64"])
    assert at64.time.mfu == 0.273  # where it was measured: the measurement, unscaled
    _, at12 = _plan(bf16)  # the guide's micro-batch 12
    eff = saturation(gemm_size(12, 1024, 768), curve.half) / saturation(gemm_size(64, 1024, 768), curve.half)
    assert at12.time.mfu == pytest.approx(0.273 * eff) and 0.75 < eff < 0.8
    _, at24 = _plan([*bf16, "train.micro_batch_size=24"])
    assert at24.time.step_s / at12.time.step_s == pytest.approx(at12.time.mfu / at24.time.mfu, rel=1e-3)
    _, tp2 = _plan([*bf16, "train.micro_batch_size=24", "parallel.tp_size=2"])
    assert tp2.time.mfu == pytest.approx(at12.time.mfu)  # half of 24 sequences' products on each GPU
    _, site = _plan([*bf16, "cluster.mfu=0.35"])
    assert site.time.mfu == pytest.approx(0.35 * saturation(gemm_size(12, 1024, 768), curve.half))
    _, cpu = _plan(["+experiment=codeparrot_smoke", "train.micro_batch_size=1"])
    _, cpu4 = _plan(["+experiment=codeparrot_smoke", "train.micro_batch_size=4"])
    assert cpu.time.mfu == cpu4.time.mfu == 0.3


def test_pipeline_transfers_cross_the_network_between_nodes(h100):
    """Every micro-batch's activations forward and gradients back (b·s·h each way) on the slowest link:
    the network once the run spans nodes, NVLink within one."""
    _, two = _plan([*CP, *h100, "parallel.pp_size=2", "train.micro_batch_size=4"])
    m = 192 // (4 * 4)
    assert two.time.p2p_s == pytest.approx(2 * m * 4 * 1024 * 768 * 2 / 25e9)
    _, one = _plan([*CP, *h100, "cluster.gpus=4", "parallel.pp_size=2", "train.micro_batch_size=4"])
    assert one.time.p2p_s == pytest.approx(2 * (192 // 8) * 4 * 1024 * 768 * 2 / 450e9)


def test_a_data_parallel_exchange_inside_a_node_runs_at_the_nodes_bandwidth(h100):
    _, one = _plan([*CP, *h100, "cluster.gpus=4"])
    _, two = _plan([*CP, *h100, "cluster.gpus=8"])
    params, dp1, dp2 = one.memory.params, 4, 8
    assert one.time.exchange_s == pytest.approx(params * 4 * 2 * (dp1 - 1) / dp1 / 450e9)
    assert two.time.exchange_s == pytest.approx(params * 4 * 2 * (dp2 - 1) / dp2 / 25e9)


def test_one_headroom_rule_for_the_memory_check_and_the_search(h100):
    """The issue's 1.3B example: its first choice was micro-batch 16 at 77 of 80 GiB. A stated margin
    (cluster.memory_headroom, 10% of the memory after reserved_memory_gb) now refuses a layout above it,
    hand-written or searched, and the key moves it."""
    exp = ["+experiment=gpt_1p3b", *h100]
    tight = ["parallel.pp_size=1", "parallel.virtual_pp_size=1", "train.micro_batch_size=16",
             "train.recompute_granularity=none", "optim.distributed=false"]
    cfg, plan = _plan([*exp, *tight])
    mem = plan.memory
    assert mem.device_bytes == 80 * GIB and mem.reserved_bytes == 2 * GIB
    assert mem.limit_bytes == 2 * GIB + int(78 * GIB * 0.9) < mem.total_bytes < mem.device_bytes
    (p,) = [p for p in plan.problems if p.code == "memory"]
    assert "72.2 of them for the estimate (cluster.memory_headroom=0.1" in p.message
    assert "limit (10% headroom)           72.20 GiB  DOES NOT FIT" in format_plan(cfg, plan, {})
    _, loose = _plan([*exp, *tight, "cluster.memory_headroom=0"])
    assert loose.memory.fits and not [p for p in loose.problems if p.code == "memory"]
    _, auto = _plan([*exp, "layout=auto", "tune=true"])
    limit = auto.proposal.ranked[0].memory.limit_bytes
    assert all(r.memory.total_bytes <= limit for r in auto.proposal.ranked)
    first = auto.proposal.ranked[0]
    assert first.memory.total_bytes < 0.7 * first.memory.device_bytes, first.candidate.name
    assert any(d.code == "memory" and "of 72.20 GiB" in d.detail for d in auto.proposal.dropped)
    _, loose = _plan([*exp, "layout=auto", "cluster.memory_headroom=0"])
    assert max(r.memory.total_bytes for r in loose.proposal.ranked) > limit
    _, bad = _plan([*exp, "cluster.memory_headroom=1"])
    assert ("range", "cluster.memory_headroom") in {(p.code, p.key) for p in bad.problems}


def test_the_experiments_own_micro_batch_is_a_candidate(h100):
    """The guide's micro-batch 12 is no power of two: it is searched beside autotune.micro_batch_sizes."""
    _, plan = _plan([*CP, *h100, "layout=auto"])
    assert 12 not in compose_cfg(CP).autotune.micro_batch_sizes
    assert any(r.candidate.micro_batch == 12 and r.candidate.tp == 1 for r in plan.proposal.ranked)
    _, other = _plan([*CP, *h100, "layout=auto", "train.micro_batch_size=6"])
    assert {r.candidate.micro_batch for r in other.proposal.ranked} >= {6} and not any(
        r.candidate.micro_batch == 12 for r in other.proposal.ranked)
