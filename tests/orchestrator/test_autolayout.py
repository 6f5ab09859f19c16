"""layout=auto, the proposal (issue 41, item 1): the plan searches the layouts of the run's world and global
batch, keeps those its own rules accept and its memory estimate fits, ranks them by its step-time
estimate, prints the first few and why the others were dropped; ``dry_run=true`` submits nothing. Pure:
no job runs (the trials are tests/orchestrator/test_autotune_local.py and test_autotune_devcluster.py)."""

from __future__ import annotations

import io
from collections import Counter
from itertools import groupby

import pytest

from orchestrator.launch.flow import launch
from orchestrator.planning.autolayout import Candidate, apply
from orchestrator.planning.plan import PlanInputs, make_plan
from orchestrator.stages import get as stage_def
from orchestrator.stages.tune import NAME as TUNE
from orchestrator.stages.tuning import spelled, write_table
from tests.orchestrator.conftest import compose_cfg
from tests.orchestrator.sites import H100_X4, docs_site, site_file
from trainer.formulas import PipelineSplit

KEY = {"WANDB_API_KEY": "k" * 40}
H200_X1 = H100_X4.replace("gpus_per_node: 4", "gpus_per_node: 1").replace("H100-80GB", "H200")


def _plan(overrides, run_dir="/runs/r"):
    cfg = compose_cfg(overrides)
    return cfg, make_plan(cfg, PlanInputs("r", run_dir, environ=KEY), exists=lambda p: True)


def _manual(cfg, cand: Candidate, proposal):
    """The candidate as a user would pin it (layout=manual), planned from scratch."""
    alt = apply(cfg, cand, proposal.global_batch, proposal.tasks_per_node)
    alt.layout = "manual"
    return make_plan(alt, PlanInputs("r", "/runs/r", environ=KEY), exists=lambda p: True)


@pytest.fixture
def h100(tmp_path):
    """CodeParrot on 2 nodes of 4 H100s (docs/cluster.md's walkthrough site): world 8, global batch 192."""
    return site_file(tmp_path, "mysite", H100_X4)


def test_the_search_keeps_the_math_and_judges_each_layout_by_the_plans_own_rules(h100):
    cfg, plan = _plan(["+experiment=codeparrot", *h100, "layout=auto"])
    p = plan.proposal
    assert (p.world, p.tasks_per_node, p.global_batch) == (8, 4, 192) and not plan.problems
    grid = {(c.tp, c.pp) for c in [r.candidate for r in p.ranked] + [d.candidate for d in p.dropped]}
    assert {tp for tp, _ in grid} == {1, 2, 4}  # tp within a 4-GPU node: never 8
    assert grid == {(tp, pp) for tp in (1, 2, 4) for pp in range(1, 9) if 8 % (tp * pp) == 0}
    steps = [r.time.step_s for r in p.ranked]
    assert steps == sorted(steps) and len(p.ranked) > 50
    for r in p.ranked:
        c = r.candidate
        split = PipelineSplit(12, c.pp, c.vpp, c.first, c.last)
        assert 12 % c.tp == 0 and split.problem() is None and c.tp * c.pp * r.dp == 8
        assert (c.first, c.last) == (None, None) if 12 % c.pp == 0 else max(split.stage_counts()) == 3
        assert 192 % (c.micro_batch * r.dp) == 0 and r.memory.fits
        assert c.sequence_parallel == (c.tp > 1) and (r.dp > 1 or not c.distributed)
    # Each ranked layout, pinned by hand, is a plan without problems and the same estimates ...
    for r in [*p.ranked[:6], p.ranked[-1]]:
        manual = _manual(cfg, r.candidate, p)
        assert manual.problems == [], (r.candidate.name, manual.problems)
        assert manual.memory == r.memory and manual.time.step_s == r.time.step_s
    # ... and each dropped one, pinned by hand, is refused for the reason the table gives.
    reasons = Counter(d.code for d in p.dropped)
    assert {"batch", "vpp_layers"} <= set(reasons)  # pp_layers: every pp splits 12 layers (evenly or not)
    for code in reasons:
        d = next(d for d in p.dropped if d.code == code)
        assert code in {x.code for x in _manual(cfg, d.candidate, p).problems}, (code, d.candidate.name)
    # The plan itself is the first choice's.
    first = p.ranked[0].candidate
    assert (plan.layout.tp, plan.layout.pp, plan.config.train.micro_batch_size) == (
        first.tp, first.pp, first.micro_batch)


def test_layers_that_pp_does_not_divide_are_split_unevenly_as_megatron_does():
    """3 layers on the smoke run's 4 ranks: pp=2 is tried as Megatron's uneven splits (1+2 and 2+1, the
    busiest stage holding 2), pp=4 cannot split 3 layers at all and is dropped for it; an uneven candidate
    pinned by hand with the words the tuning table prints is the same plan, without problems."""
    over = ["+experiment=codeparrot_smoke", "model.num_layers=3", "layout=auto"]
    cfg, plan = _plan(over)
    p = plan.proposal
    assert not plan.problems and {d.candidate.pp for d in p.dropped if d.code == "pp_layers"} == {4}
    two = {(c.first, c.last, c.stages) for c in [r.candidate for r in p.ranked] if c.pp == 2}
    assert two == {(1, None, (1, 2)), (2, None, (2, 1))}  # with two stages the first count says it all
    r = next(r for r in p.ranked if r.candidate.pp == 2)
    assert f"pp2[{'+'.join(map(str, r.candidate.stages))}]" in r.candidate.name
    manual = _manual(cfg, r.candidate, p)
    assert manual.problems == [] and manual.memory == r.memory and manual.time.step_s == r.time.step_s
    words = spelled(r.candidate.overrides()).split()
    _, pinned = _plan([*over[:2], "layout=manual", *words])
    assert pinned.problems == [] and pinned.time.step_s == r.time.step_s
    tcfg = pinned.stage("train").job.trainer_config["parallel"]
    assert (tcfg["first_stage_layers"], tcfg["last_stage_layers"]) == (r.candidate.first, r.candidate.last)


def test_the_dry_run_prints_the_table_and_the_trial_array_and_submits_nothing(h100, tmp_path):
    cfg = compose_cfg(["+experiment=codeparrot", *h100, "layout=auto", "tune=true", "autotune.concurrency=2",
                       "dry_run=true", f"runs_root={tmp_path}/runs"])
    text = launch(cfg, out=io.StringIO()).text
    head = text[:text.index("Stages:")]
    assert "Auto layout (layout=auto): world 8 = 2 node(s) × 4 task(s), global batch 192" in head
    assert head.count("(trial)") == 4 and "← first choice" in head and "more that fit" in head
    # counted, with an example
    assert "× pp × virtual_pp_size does not divide the layers: e.g. tp1 pp4 vpp2 mb1" in head
    tune = text.split("----- tune job script -----")[1].split("-----")[0]
    assert "#SBATCH --array=0-3%2" in tune and "#SBATCH --gpus-per-node=4" in tune
    assert "#SBATCH --nodes=2" in tune
    assert "tune_%A_%a_%t.out" in tune and "--no-requeue" in tune
    train = text.split("----- train job script -----")[1].split("-----")[0]
    assert "#SBATCH --dependency='afterok:<preprocess>,afterany:<tune>'" in train
    assert not (tmp_path / "runs").exists()


def test_one_gpu_searches_micro_batches_and_recomputation_within_its_memory(tmp_path):
    """The GPU case of issue 41 (1.3B on one H200): only micro-batch and recomputation vary; what does not
    fit below the headroom is dropped for memory. Same FLOPs, no pipeline, no exchange: the estimate once
    tied every micro-batch and the tie went to micro-batch 1 (issue 52 item 5's follow-up). With the
    measured micro-batch efficiency a larger micro-batch computes faster: the first choice is the largest
    that fits without recomputation (16, 76 of 127 GiB) and micro-batch 1 is the slowest of those."""
    over = site_file(tmp_path, "h200", H200_X1)
    _, plan = _plan(["+experiment=gpt_1p3b", *over, "cluster.gpus=1", "layout=auto", "tune=true"])
    p = plan.proposal
    assert p.world == 1 and all((r.candidate.tp, r.candidate.pp, r.dp) == (1, 1, 1) for r in p.ranked)
    assert {d.code for d in p.dropped} == {"memory"} and max(d.candidate.micro_batch for d in p.dropped) == 64
    plain = [r for r in p.ranked if r.candidate.recompute == "none"]
    assert [r.candidate.micro_batch for r in plain] == [16, 8, 4, 2, 1]
    steps = [r.time.step_s for r in plain]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)  # no tie left among them
    first = p.ranked[0]
    assert first.candidate.name == "tp1 pp1 mb16" and first.memory.total_bytes <= first.memory.limit_bytes
    assert [r.candidate.micro_batch for r in p.trials(4)] == [16, 8, 16, 4]  # the third selective
    assert plan.stage(TUNE).array == (4, 1)


def test_the_docs_sites_examples_take_the_largest_micro_batch_under_the_headroom(tmp_path):
    """docs/cluster.md's site (nodes of 4 H100 80GB). CodeParrot-small on 8 GPUs: the guide's micro-batch
    12 first (the largest searched that splits 24 sequences per GPU; it tied with 8 and lost on memory
    before the micro-batch efficiency), tp1 before any tp2 or tp4. The 1.3B on 16 GPUs: data parallel
    with micro-batch 8 below the headroom, not micro-batch 1 (the slowest there); among the layouts that
    differ only in their micro-batch the larger one is faster."""
    site = site_file(tmp_path, "mysite", docs_site())
    _, small = _plan(["+experiment=codeparrot", *site, "layout=auto"])
    assert small.proposal.ranked[0].candidate.name == "tp1 pp1 mb12"
    tps = [r.candidate.tp for r in small.proposal.ranked]
    assert tps.index(2) > tps.index(1) and tps.index(4) > tps.index(2)
    _, plan = _plan(["+experiment=gpt_1p3b", *site, "layout=auto"])
    first = plan.proposal.ranked[0]
    assert first.candidate.name == "tp1 pp1 mb8" and first.memory.total_bytes <= first.memory.limit_bytes
    same = {r.candidate.micro_batch: r.time.step_s for r in plan.proposal.ranked
            if r.candidate.name.startswith("tp1 pp1 mb") and r.candidate.name.count(" ") == 2}
    assert list(same) == [8, 4, 2, 1] and same[8] < same[4] < same[2] < same[1]


def test_equal_estimates_go_to_the_layout_that_needs_less_memory():
    """Where the estimate cannot tell layouts apart — micro-batches on CPUs, where no efficiency curve is
    measured (the smoke run on the local executor) — the one with less memory comes first."""
    _, plan = _plan(["+experiment=codeparrot_smoke", "layout=auto"])
    ties = [list(g) for _, g in groupby(plan.proposal.ranked, key=lambda r: f"{r.time.step_s:.9g}")]
    ties = [g for g in ties if len(g) > 1]
    assert len(ties) >= 3
    assert [r.candidate.name for r in ties[0]] == ["tp1 pp1 mb1", "tp1 pp1 mb2", "tp1 pp1 mb4"]
    for group in ties:
        memory = [r.memory.total_bytes for r in group]
        assert memory == sorted(memory), [r.candidate.name for r in group]


def test_nothing_that_fits_is_one_problem_naming_why(tmp_path):
    over = site_file(tmp_path, "small", H100_X4 + "device_memory_gb: 1\n")
    _, plan = _plan(["+experiment=codeparrot", *over, "layout=auto"])
    (p,) = [x for x in plan.problems if x.code == "auto_layout"]
    assert "none of the" in p.message and "does not fit in device memory" in p.message
    assert "cluster.gpus" in p.fix


def test_tune_measures_only_an_auto_layout_and_its_settings_are_checked():
    _, plan = _plan(["+experiment=codeparrot_smoke", "tune=true"])
    assert "tune_manual" in {p.code for p in plan.problems}
    _, plan = _plan(["+experiment=codeparrot_smoke", "layout=auto", "tune=true", "autotune.iters=7"])
    assert ("interval", "autotune.iters") in {(p.code, p.key) for p in plan.problems}


def test_without_tune_training_takes_the_first_choice_and_the_local_world_stays():
    """The smoke run (local, 4 processes for tp=2 × pp=2): every candidate keeps 4 ranks and the batch."""
    cfg, plan = _plan(["+experiment=codeparrot_smoke", "layout=auto"])
    p = plan.proposal
    assert p.world == 4 and all(r.candidate.tp * r.candidate.pp * r.dp == 4 for r in p.ranked)
    assert [s.name for s in plan.stages if s.name == TUNE] == []
    tcfg = plan.stage("train").job.trainer_config
    for section, values in p.ranked[0].candidate.overrides().items():
        assert {k: tcfg[section][k] for k in values} == values
    assert tcfg["train"]["global_batch_size"] == 16 and plan.config.cluster.tasks_per_node == 4


def test_a_decision_for_this_tuning_is_reused_unless_forced(tmp_path):
    over = ["+experiment=codeparrot_smoke", "layout=auto", "tune=true"]
    _, plan = _plan(over, str(tmp_path))
    tune, definition = plan.stage(TUNE), stage_def(TUNE)
    assert definition.complete(tune) is None  # nothing decided yet
    c = tune.job.candidates[1]
    write_table(str(tmp_path), {"key": tune.key, "tune_job": "7", "trials": 1, "winner": 1, "speedup": None,
                                "spearman": None, "spearman_n": 1,
                                "rows": [{**c, "status": "measured", "reason": "", "measured_rank": 1,
                                          "measured": {"tokens_per_s": 10.0, "step_s": 1.0}}]})
    assert f"decided already: {c['name']}" in definition.complete(tune)
    _, forced = _plan([*over, "tune=force"], str(tmp_path))
    assert forced.stage(TUNE).key == tune.key and definition.complete(forced.stage(TUNE)) is None
    _, other = _plan([*over, "autotune.iters=30"], str(tmp_path))  # another measurement: another tuning
    assert definition.complete(other.stage(TUNE)) is None
