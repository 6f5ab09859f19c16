"""Nothing the plan can know fails in the queue (issue 37, items 4 and 9): each is refused (or said) at plan
time with its fix, and the plan prints the recipe it will run."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from orchestrator.base.estimate import estimate_memory
from orchestrator.base.layout import layout_of
from orchestrator.base.problems import PlanError
from orchestrator.planning.plan import PlanInputs, make_plan
from orchestrator.planning.plan_format import format_plan
from tests.orchestrator.conftest import REPO, compose_cfg
from tests.orchestrator.sites import H100_X4, site_file

KEY = {"WANDB_API_KEY": "k" * 40}
CP = ["+experiment=codeparrot"]


def _plan(overrides, environ=None):
    cfg = compose_cfg(overrides)
    return cfg, make_plan(cfg, PlanInputs("r", "/runs/r", environ=KEY if environ is None else environ),
                          exists=lambda p: True)


def _problems(plan, code):
    return [p for p in plan.problems if p.code == code]


# --- item 4 ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tasks", [4, 16])
def test_tasks_per_node_other_than_one_per_gpu_is_refused(tasks):
    _, plan = _plan([*CP, "cluster=slurm", f"cluster.tasks_per_node={tasks}", "train.global_batch_size=192",
                     "train.micro_batch_size=12" if tasks == 4 else "train.micro_batch_size=6"])
    (p,) = _problems(plan, "tasks_per_node")
    assert p.key == "cluster.tasks_per_node" and p.fix.startswith("cluster.tasks_per_node=null")
    _, ok = _plan([*CP, "cluster=slurm", "cluster.tasks_per_node=8"])
    assert _problems(ok, "tasks_per_node") == []


@pytest.mark.parametrize("over,code,key,fix", [
    (["train.precision_recipe=autocast", "optim.distributed=true"], "recipe", "train.precision_recipe",
     "set train.precision_recipe=master_weights (or auto), or optim.distributed=false"),
    (["train.precision_recipe=master_weights", "optim.impl=apex"], "recipe_impl", "optim.impl",
     "set optim.impl to auto, csrc, foreach or for_loop, or train.precision_recipe=autocast"),
    (["train.precision_recipe=auto", "optim.impl=torch_fused"], "recipe_impl", "optim.impl",
     "train.precision_recipe=autocast"),
])
def test_a_precision_recipe_the_optimizer_cannot_keep_is_refused_at_plan_time(over, code, key, fix):
    """The distributed optimizer keeps 16-bit parameters with fp32 masters (Megatron's layout), so autocast's
    fp32 parameters cannot go with it; apex's and torch's fused Adam step whole parameters, not the masters
    (issue 39 item 3). auto resolves by the optimizer, so it is refused only where it would be the latter."""
    _, plan = _plan([*CP, "train.precision=bf16", *over])
    if over[0].endswith("=auto"):  # auto without the distributed optimizer is autocast: nothing to refuse
        assert _problems(plan, code) == [] and _problems(plan, "recipe") == []
        _, plan = _plan([*CP, "train.precision=bf16", *over, "optim.distributed=true"])
        assert _problems(plan, code) == []  # auto with it is master_weights on the distributed optimizer
        return
    (p,) = _problems(plan, code)
    assert p.key == key and fix in p.fix, str(p)
    _, fp32 = _plan([*CP, "train.precision=fp32", *over])  # the recipe does not apply to fp32
    assert _problems(fp32, code) == []
    _, cpu = _plan(["+experiment=codeparrot_smoke", "cluster=devcluster", "cluster.tasks_per_node=2"])
    assert _problems(cpu, "tasks_per_node") == []  # CPU tasks are the site's to choose


def test_a_misspelled_wandb_mode_is_refused_at_plan_time():
    """WandbConfig's own rule was never called by the logging section: the job failed in the queue."""
    _, plan = _plan(["+experiment=codeparrot_smoke", "logging.wandb.mode=offlin"])
    (p,) = [p for p in plan.problems if p.key == "logging.wandb.mode"]
    assert p.code == "choice" and "online, offline, disabled" in p.message


def _netrc(tmp_path, where="home"):
    path = tmp_path / where / ".netrc"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("machine api.wandb.ai\n  login user\n  password " + "a" * 40 + "\n")
    path.chmod(0o600)
    return {"NETRC": str(path)}


def test_a_wandb_key_only_in_netrc_is_refused_for_pyxis_which_mounts_no_home(tmp_path):
    env = _netrc(tmp_path)
    _, plan = _plan([*CP, "container=pyxis"], environ=env)
    (p,) = _problems(plan, "wandb_key_home")
    assert str(tmp_path / "home" / ".netrc") in p.message and "export WANDB_API_KEY" in p.fix
    for fine in ([*CP, "container=apptainer_ngc"], [*CP, "container=none"]):  # home is there
        assert _problems(_plan(fine, environ=env)[1], "wandb_key_home") == []
    assert _problems(_plan([*CP, "container=pyxis"], environ={**env, **KEY})[1], "wandb_key_home") == []
    mounted = _netrc(tmp_path, "secrets")
    over = [*CP, "container=pyxis", f"container.binds=[{tmp_path / 'secrets'}]"]
    assert _problems(_plan(over, environ=mounted)[1], "wandb_key_home") == []


def test_a_time_limit_short_of_one_iteration_gets_a_fix_that_can_work(tmp_path):
    """The fix once read "lower train.save_interval to <= 0" when not one iteration fit."""
    site = site_file(tmp_path, "mysite", H100_X4)
    cfg, plan = _plan([*CP, *site, "train.global_batch_size=192000", "train.save_interval=10",
                       "cluster.time_limit_min=3"])
    lead = cfg.cluster.signal_delay_s
    (p,) = _problems(plan, "time_limit")
    assert plan.time.step_s > 3 * 60 - lead and "save_interval" not in p.fix and "<= 0" not in p.fix
    need = int(p.fix.split(">= ")[1].split()[0])
    assert need * 60 - lead >= plan.time.first_checkpoint_s  # the fix's limit reaches the checkpoint
    _, plan = _plan([*CP, *site, "train.save_interval=150000", "cluster.time_limit_min=10"])
    (p,) = _problems(plan, "time_limit")
    fit = int(p.fix.split("save_interval to <= ")[1].split()[0])
    assert fit >= 1 and fit * plan.time.step_s <= 10 * 60 - lead


@pytest.mark.parametrize("prefix", ["+", "++"])
def test_an_unknown_key_is_refused_also_when_added_with_plus(prefix):
    """Hydra's own hint for a typo (``+optim.lrr=3e-4``) used to add a key that typing then dropped."""
    with pytest.raises(PlanError) as err:
        compose_cfg(["+experiment=codeparrot_smoke", f"{prefix}optim.lrr=3e-4"])
    (p,) = err.value.problems
    assert (p.code, p.key) == ("unknown_key", "optim.lrr") and "did you mean optim.lr=0.0003?" in p.fix
    # Mappings take any key: the documented way to exclude a node still works.
    cfg = compose_cfg(["+experiment=codeparrot_smoke", "+cluster.sbatch_extra.exclude=node7"])
    assert cfg.cluster.sbatch_extra == {"exclude": "node7"}


def test_launch_py_refuses_an_added_unknown_key_with_exit_2(tmp_path):
    out = subprocess.run([sys.executable, "launch.py", "+experiment=codeparrot_smoke", "+train.itrs=5",
                          "dry_run=true", f"runs_root={tmp_path}"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ))
    assert out.returncode == 2 and "[unknown_key] train.itrs=5" in out.stderr, out.stdout + out.stderr
    assert "did you mean train.iters=5?" in out.stderr and "Slipway plan" not in out.stdout


@pytest.mark.parametrize("override,key,guess", [
    ("optim.lr=3e4", "optim.lr=30000", "did you mean 0.0003?"),
    ("optim.weight_decay=10", "optim.weight_decay=10", "at most 1;"),
    ("optim.adam_eps=0.1", "optim.adam_eps=0.1", "at most 0.001;"),
    ("model.init_std=2", "model.init_std=2", "at most 1;"),
])
def test_values_far_outside_any_sane_range_are_flagged(override, key, guess):
    """Flagged before submitting (in the dry run's plan and as a warning at launch), not refused: a run may
    diverge on purpose (the fault tests do)."""
    cfg, plan = _plan([*CP, override])
    (w,) = [w for w in plan.warnings if "far above any pre-training recipe" in w]
    assert w.startswith(key) and guess in w and "diverge" in w
    assert "far above any pre-training recipe" in format_plan(cfg, plan, {}).split("Warnings:")[1]
    assert not [w for w in _plan(CP)[1].warnings if "far above" in w]


def test_the_plan_prints_the_training_recipe():
    cfg, plan = _plan(CP)
    text = format_plan(cfg, plan, {})
    recipe = text.split("recipe: ")[1].split("\n\n")[0]
    for part in ("lr 0.0005 → min_lr 0", "2000 warm-up iterations", "cosine decay to iteration 150000",
                 "weight decay 0.1", "global batch 192 × seq 1024 = 196,608 tokens per step",
                 "150000 iterations = 29.49 B tokens", "precision fp16"):
        assert part in recipe, (part, recipe)


# --- item 9 ------------------------------------------------------------------------------------------

def test_cpu_stages_on_the_gpu_partition_are_said(tmp_path):
    _, plan = _plan([*CP, "cluster=slurm"])
    assert any("CPU-only stages" in w and "stage_partition" in w for w in plan.warnings)
    cfg, plan = _plan([*CP, *site_file(tmp_path, "mysite", H100_X4)])  # it names a CPU partition
    assert not any("CPU-only stages" in w for w in plan.warnings)
    assert "CPU-only stages" not in format_plan(cfg, plan, {})


def test_a_batch_error_prints_no_micro_batches_and_no_eta():
    cfg, plan = _plan([*CP, "train.global_batch_size=100"])
    assert [p.code for p in plan.problems] == ["batch"]
    text = format_plan(cfg, plan, {})
    assert "0 micro-batch(es)" not in text and "\n  ETA" not in text
    assert "does not split into micro-batches" in text and "Time: not estimated" in text


def test_tensor_parallel_across_nodes_is_warned(tmp_path):
    site = site_file(tmp_path, "mysite", H100_X4)
    _, plan = _plan(["+experiment=llama_1b", *site, "parallel.tp_size=8", "train.global_batch_size=512"])
    assert any("parallel.tp_size=8 spans nodes" in w for w in plan.warnings), plan.warnings
    _, plan = _plan(["+experiment=llama_1b", *site, "parallel.tp_size=4"])
    assert not any("spans nodes" in w for w in plan.warnings)


def test_a_model_that_fits_nowhere_says_how_many_gpus_it_needs(tmp_path):
    small = site_file(tmp_path, "small", H100_X4.replace("device_name: H100-80GB",
                                                         "device_name: small8\ndevice_memory_gb: 8\n"
                                                         "device_peak_tflops: 65"))
    mb = "train.micro_batch_size=16"
    cfg, plan = _plan(["+experiment=gpt_1p3b", *small, "cluster.gpus=8", mb])
    (p,) = _problems(plan, "memory")
    found = re.search(r"one model replica fits on (\d+) GPUs \(parallel\.tp_size=(\d+) "
                      r"parallel\.pp_size=(\d+)", p.message)
    assert found, p.message
    n, tp, pp = map(int, found.groups())
    assert n == tp * pp > 2 and tp <= 4  # tensor parallelism stays within a node of 4

    def fits(t: int, q: int) -> bool:  # the plan's own estimate with every memory saver
        alt = compose_cfg(["+experiment=gpt_1p3b", *small, mb, f"cluster.gpus={t * q}",
                           f"parallel.tp_size={t}", f"parallel.pp_size={q}", "parallel.virtual_pp_size=1",
                           f"parallel.sequence_parallel={str(t > 1).lower()}", "train.global_batch_size=null",
                           "train.recompute_granularity=full"])
        # One replica: t × q tasks on one node (not cluster.gpus=6 on nodes of 4, which is no layout).
        alt = dataclasses.replace(alt, cluster=dataclasses.replace(alt.cluster, max_nodes=None, nodes=1,
                                                                   gpus=None, tasks_per_node=t * q))
        return estimate_memory(alt, plan.vocab_size, layout_of(alt)).fits

    assert fits(tp, pp)
    assert not any(fits(t, q) for t in (1, 2, 4) for q in (1, 2, 3, 4, 6, 8, 12, 24) if t * q < n)


def test_docs_are_current_about_gpus_and_the_stage_chain():
    ops = (REPO / "docs" / "operations.md").read_text()
    assert "no GPU has\nbeen lent" not in ops and "gpu_check_20261204T131708Z.txt" in ops
    cluster = (REPO / "docs" / "cluster.md").read_text()
    assert "train → convert → eval" in cluster and "eval        submitted" in cluster
