"""Every shipped config composes into the typed schema; typos and wrong types fail at composition."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from orchestrator.base.layout import layout_of
from orchestrator.base.plan_types import Context
from orchestrator.checks import run_checks
from orchestrator.planning.plan import PlanInputs, make_plan
from tests.orchestrator.conftest import CONF, compose_cfg, group_options

EXPERIMENTS = group_options("experiment")
CLUSTERS = group_options("cluster")
CONTAINERS = group_options("container")


def test_groups_present():
    assert {"codeparrot", "codeparrot_smoke"} <= set(EXPERIMENTS)
    assert {"local", "slurm"} <= set(CLUSTERS)
    for group in (
        "data",
        "tokenizer",
        "model",
        "parallel",
        "optim",
        "train",
        "cluster",
        "container",
        "logging",
    ):
        assert group_options(group), group


@pytest.mark.parametrize(
    "experiment,cluster,container", list(itertools.product(EXPERIMENTS, CLUSTERS, CONTAINERS))
)
def test_every_combination_composes(experiment, cluster, container):
    cfg = compose_cfg([f"+experiment={experiment}", f"cluster={cluster}", f"container={container}"])
    assert cfg.experiment == experiment
    assert cfg.cluster.name == cluster
    # Composition is typed: a command-line group choice wins over the experiment's default.
    assert cfg.container.kind == OmegaConf.load(CONF / "container" / f"{container}.yaml").kind


# The combinations each experiment is meant for validate clean (file checks see the files as present:
# the CodeParrot data lives on the user's cluster).
INTENDED = [
    ("codeparrot", "slurm", "apptainer_ngc"),
    ("codeparrot", "slurm", "pyxis"),
    ("codeparrot", "slurm", "none"),
    ("codeparrot_smoke", "local", "none"),
    ("codeparrot_smoke", "slurm", "none"),
]
if "devcluster" in CLUSTERS:
    INTENDED.append(("codeparrot_smoke", "devcluster", "none"))


@pytest.mark.parametrize("experiment,cluster,container", INTENDED)
def test_intended_combinations_validate(experiment, cluster, container):
    cfg = compose_cfg([f"+experiment={experiment}", f"cluster={cluster}", f"container={container}"])
    # codeparrot logs to W&B online: clean only where the launching environment holds a key
    assert run_checks(Context(cfg, {"WANDB_API_KEY": "k" * 40}, exists=lambda p: True), at="plan") == []


def test_codeparrot_is_the_seed_run():
    c = compose_cfg(["+experiment=codeparrot"])
    assert (c.model.num_layers, c.model.hidden_size, c.model.num_attention_heads) == (12, 768, 12)
    assert (c.model.seq_length, c.model.max_position_embeddings) == (1024, 1024)
    assert (c.train.micro_batch_size, c.train.global_batch_size, c.train.iters) == (12, 192, 150000)
    assert (c.optim.lr, c.optim.warmup_iters, c.optim.decay_iters, c.optim.decay_style) == (
        5e-4,
        2000,
        150000,
        "cosine",
    )
    assert (c.optim.weight_decay, c.optim.adam_beta2, c.train.precision) == (0.1, 0.999, "fp16")
    assert (c.train.log_interval, c.train.save_interval, c.train.eval_interval, c.train.eval_iters) == (
        10,
        2000,
        200,
        10,
    )
    assert (c.parallel.tp_size, c.parallel.pp_size, c.cluster.nodes, c.cluster.gpus_per_node) == (1, 1, 1, 8)
    assert (c.data.json_key, c.data.split) == ("content", "969,30,1")
    assert c.tokenizer.vocab_file.endswith("vocab.json") and c.tokenizer.merge_file.endswith("merges.txt")
    assert c.cluster.executor == "slurm" and c.container.kind == "apptainer"
    assert compose_cfg(["+experiment=codeparrot", "train.precision=bf16"]).train.precision == "bf16"


def test_smoke_is_tp2_pp2_world4_on_cpu():
    c = compose_cfg(["+experiment=codeparrot_smoke"])
    assert (c.parallel.tp_size, c.parallel.pp_size, c.cluster.gpus_per_node) == (2, 2, 0)
    assert layout_of(c).world == 4 and layout_of(c).tasks_per_node == 4  # local: 4 processes
    d = compose_cfg(["+experiment=codeparrot_smoke", "cluster=devcluster"])
    assert (layout_of(d).nodes, layout_of(d).tasks_per_node, d.cluster.partition) == (2, 2, "cpu")
    assert c.data.corpus is not None and c.tokenizer.vocab_file is None
    assert c.logging.wandb.mode == "offline" and c.cluster.executor == "local"


def test_bare_launch_is_the_smoke_experiment_and_plans_clean():
    """`python launch.py` without +experiment composes the embedded smoke run (only the experiment name,
    the first folder of the run directory, differs) and its plan has no problems."""
    bare, smoke = compose_cfg([]), compose_cfg(["+experiment=codeparrot_smoke"])
    assert (bare.experiment, smoke.experiment) == ("smoke", "codeparrot_smoke")
    assert dataclasses.replace(bare, experiment=smoke.experiment) == smoke
    plan = make_plan(bare, PlanInputs("r", "/runs/r"), exists=lambda p: True)
    assert plan.problems == [], [str(p) for p in plan.problems]


@pytest.mark.parametrize(
    "override,needle",
    [
        ("optim.lrr=1e-4", "optim.lrr"),  # typo'd key
        ("train.iters=many", "train.iters"),  # wrong type
        ("model.hidden_size=1.5", "model.hidden_size"),  # float for int
        ("cluster=nosuchcluster", "nosuchcluster"),  # unknown group option
    ],
)
def test_typos_and_types_fail_at_composition(override, needle):
    with pytest.raises(ConfigCompositionException) as err:
        compose_cfg(["+experiment=codeparrot", override])
    assert needle in str(err.value) + str(err.value.__cause__)


def test_user_keys_exist():
    c = compose_cfg([])
    for dotted in (
        "model.num_layers",
        "model.hidden_size",
        "model.num_attention_heads",
        "model.seq_length",
        "parallel.tp_size",
        "parallel.pp_size",
        "parallel.sequence_parallel",
        "train.micro_batch_size",
        "train.global_batch_size",
        "train.iters",
        "train.precision",
        "train.seed",
        "train.save_interval",
        "train.eval_interval",
        "optim.lr",
        "optim.min_lr",
        "optim.warmup_iters",
        "optim.weight_decay",
        "kernels",
        "cluster.nodes",
        "cluster.gpus_per_node",
        "cluster.time_limit_min",
        "cluster.max_retries",
        "logging.wandb.mode",
        "data.paths",
        "data.json_key",
        "tokenizer.vocab_file",
        "tokenizer.merge_file",
        "run_dir",
        "dry_run",
        "wait",
    ):
        obj = c
        for part in dotted.split("."):
            assert hasattr(obj, part), dotted
            obj = getattr(obj, part)
