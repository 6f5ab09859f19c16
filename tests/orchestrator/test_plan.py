"""Plan: memory table, ETA/device-hours, stage graph with content keys, reuse; the dry run."""

from __future__ import annotations

import dataclasses
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.base.estimate import GIB, estimate_memory, stage_params
from orchestrator.base.hardware import hardware
from orchestrator.base.layout import layout_of
from orchestrator.launch.flow import launch
from orchestrator.planning.plan import PlanInputs, SweepInfo, make_plan
from orchestrator.planning.plan_format import format_plan
from orchestrator.stages.corpus import NAME as CORPUS
from orchestrator.stages.train import trainer_config
from orchestrator.stages.tune import NAME as TUNE
from tests.orchestrator.conftest import REPO, compose_cfg, stage_names
from tests.orchestrator.sites import site_file

CP = ["+experiment=codeparrot"]


def _plan(overrides, facts=None):
    cfg = compose_cfg(overrides)
    return cfg, make_plan(cfg, facts or PlanInputs("r", "/runs/r"), exists=lambda p: True)


def test_codeparrot_parameter_count_and_memory():
    cfg, plan = _plan(CP)
    # GPT-2 small shape with a 32,768 vocabulary: 12·(12h²+13h) + (V+1024)·h + 2h ≈ 111.0 M.
    assert stage_params(cfg, 32768)[1] == 12 * (12 * 768**2 + 13 * 768) + (32768 + 1024) * 768 + 2 * 768
    m = plan.memory
    assert m.params == stage_params(cfg, 32768)[0]
    # bf16 under autocast keeps fp32 parameters (the master weights), fp32 gradients, fp32 moments.
    assert (m.weights_bytes, m.grads_bytes, m.optimizer_bytes) == (4 * m.params, 4 * m.params, 8 * m.params)
    # Korthikanti et al.: s·b·h·34 bytes per layer at tp=1, 12 layers (flash SDPA keeps no s×s scores).
    s, b, h = 1024, 12, 768
    assert m.activations_bytes == int(s * b * h * 34 * 12)
    assert m.fits and m.total_bytes < 80 * GIB
    assert plan.time.device_hours == pytest.approx(plan.time.eta_s / 3600 * 8)


def test_distributed_optimizer_shards_the_state_over_dp():
    """Megatron's table: bf16 18 → 6 + 12/d bytes per parameter (CodeParrot: d = 8)."""
    _, plan = _plan(CP + ["optim.distributed=true"])
    m = plan.memory
    assert (m.weights_bytes, m.grads_bytes, m.optimizer_bytes) == (2 * m.params, 4 * m.params,
                                                                   int(12 * m.params / 8))
    _, fp32 = _plan(CP + ["optim.distributed=true", "train.precision=fp32"])
    assert fp32.memory.optimizer_bytes == fp32.memory.params  # 8 / d with d = 8


def test_the_master_weights_recipe_is_sized_as_the_trainer_keeps_it():
    """train.precision_recipe=master_weights keeps the distributed optimizer's layout at any dp (bf16
    parameters, fp32 masters and moments sharded over dp): the plan sizes that, not autocast's 16 bytes."""
    _, plan = _plan(CP + ["train.precision_recipe=master_weights"])
    m = plan.memory
    assert (m.weights_bytes, m.grads_bytes, m.optimizer_bytes) == (2 * m.params, 4 * m.params,
                                                                   int(12 * m.params / 8))


def test_tensor_parallel_shards_memory():
    cfg1, p1 = _plan(CP)
    cfg2, p2 = _plan(CP + ["parallel.tp_size=2"])
    assert p2.memory.params < 0.55 * p1.memory.params
    assert p2.memory.activations_bytes < p1.memory.activations_bytes
    # The embedding is counted padded (trainer.formulas): 50257 → 50432 rows at tp 2, 50176 stays.
    assert stage_params(cfg2, 50257)[1] - stage_params(cfg2, 50176)[1] == (50432 - 50176) * 768


def test_pipeline_first_stage_holds_p_microbatches():
    cfg = compose_cfg(CP + ["parallel.pp_size=4"])
    lay = layout_of(cfg)
    mem = estimate_memory(cfg, 32768, lay)
    base = estimate_memory(compose_cfg(CP), 32768, layout_of(compose_cfg(CP)))
    # 12/4 layers × 4 micro-batches in flight = the activations of 12 layers (as at pp=1)... but dp is 2
    # here, so 8 micro-batches exist and 4 are in flight.
    assert mem.activations_bytes == base.activations_bytes
    assert lay.dp == 2 and lay.num_microbatches == 8


def test_stage_graph_keys_and_sharing():
    cfg, plan = _plan(CP)
    assert [s.name for s in plan.stages] == stage_names(CORPUS, TUNE)  # the data is given
    assert plan.stage("train").depends_on == ("preprocess",) and plan.stage("convert").depends_on == (
        "train",
    )
    # An LR change shares preprocessing and changes training.
    _, other = _plan(CP + ["optim.lr=1e-4"])
    assert other.stage("preprocess").key == plan.stage("preprocess").key
    assert other.stage("preprocess").state_dir == plan.stage("preprocess").state_dir
    assert other.stage("train").key != plan.stage("train").key
    # What produces the data changes its key: the json key, the input file's fingerprint, the code.
    _, k = _plan(CP + ["data.json_key=text"])
    assert k.stage("preprocess").key != plan.stage("preprocess").key
    f = PlanInputs("r", "/runs/r", fingerprints={cfg.data.paths[0]: "123:456"})
    assert make_plan(cfg, f, exists=lambda p: True).stage("preprocess").key != plan.stage("preprocess").key
    c = PlanInputs("r", "/runs/r", code_version={"trainer/data": "abc"})
    assert make_plan(cfg, c, exists=lambda p: True).stage("preprocess").key != plan.stage("preprocess").key


def test_smoke_graph_has_corpus_stage_feeding_tokenizer():
    cfg, plan = _plan(["+experiment=codeparrot_smoke"])
    assert [s.name for s in plan.stages] == stage_names(TUNE)
    corpus, prep = plan.stage("corpus"), plan.stage("preprocess")
    assert corpus.job.vocab_size == cfg.tokenizer.vocab_size
    assert prep.job[0].vocab_file == os.path.join(corpus.state_dir, "vocab.json")
    assert [c.input for c in prep.job] == [os.path.join(corpus.state_dir, "corpus.jsonl")]


def test_trainer_config_is_accepted_by_the_trainer():
    from trainer.config import RunConfig

    cfg, plan = _plan(
        ["+experiment=codeparrot_smoke"],
        PlanInputs("r1", "/runs/r1", sweep=SweepInfo("sw1", "/runs/sw/sw1", 0, ("optim.lr=1e-4",))),
    )
    tc = trainer_config(cfg, PlanInputs("r1", "/runs/r1", sweep=plan.sweep), plan.stage("preprocess"))
    rc = RunConfig.from_dict(tc)
    assert rc.parallel.tp_size == 2 and rc.parallel.pp_size == 2
    assert rc.logging.wandb.group == "sw1" and "optim.lr=1e-4" in rc.logging.wandb.name
    assert rc.checkpoint.dir == "/runs/r1/checkpoints" and rc.run_id == "r1"
    assert rc.data.paths[0].endswith("/data_content_document")


def test_dry_run_prints_plan_and_scripts_and_submits_nothing(tmp_path: Path):
    env = dict(
        os.environ,
        WANDB_API_KEY="wandbsecret0123456789",
        HF_TOKEN="hf_secret_abcdefgh",
        SLIPWAY_PARTITION="hf_secret_abcdefgh",
    )  # a secret that leaks into a rendered value
    out = subprocess.run(
        [sys.executable, "launch.py", "+experiment=codeparrot", "dry_run=true", f"runs_root={tmp_path}/runs"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    text = out.stdout
    assert "Memory per device" in text and "optimizer state" in text and "activations" in text
    # codeparrot trains fp16: the plan names the recipe train.precision_recipe=auto resolves to.
    assert "precision recipe: fp16 autocast (auto): fp32 parameters, gradients and optimizer" in text
    # What each memory option would give, beside the configured total.
    assert "train.recompute_granularity=full" in text and "optim.distributed=true" in text, text
    assert "ETA" in text and "device-hours (A100-80GB × 8)" in text
    assert "----- train job script -----" in text and "#SBATCH --signal=USR2@" in text
    assert "apptainer exec $nv --cleanenv" in text and "container_exec.sh --nv python" in text  # GPUs
    assert "hf_secret_abcdefgh" not in text and "<redacted:HF_TOKEN>" in text
    assert "wandbsecret0123456789" not in text + out.stderr
    assert not (tmp_path / "runs").exists()  # nothing recorded, nothing submitted


# A site of A100-40GB nodes, the GPU the 1.3B example was sized for: slurm.yaml's facts with another device
# and (so that step ratios are the compute's alone) a network and NVLink no transfer waits on.
A100_40 = ("defaults:\n  - slurm\n  - _self_\ndevice_name: A100-40GB\nbus_bandwidth_gbps: 1.0e9\n"
           "intra_node_bandwidth_gbps: 1.0e9\n")


def test_1p3b_dry_run_shows_memory_with_and_without_each_option(tmp_path):
    """The 1.3B example fits 40 GB only with its options; the plan's table says what each one is worth,
    and each figure is the plan of the run with that one change."""
    exp = ["+experiment=gpt_1p3b", *site_file(tmp_path, "a100_40", A100_40)]
    cfg, plan = _plan(exp)
    assert plan.memory.device_bytes == 40 * GIB  # the site's device, from the device table
    assert plan.memory.fits and [p.code for p in plan.problems if p.code == "memory"] == []
    names = {o.name: o for o in plan.memory_options}
    assert set(names) == {"train.recompute_granularity=none", "train.recompute_granularity=selective",
                          "optim.distributed=false", "parallel.virtual_pp_size=1"}
    for name, option in names.items():
        _, alt = _plan([*exp, name])
        assert option.memory == alt.memory
        assert option.step_ratio == pytest.approx(alt.time.step_s / plan.time.step_s)
    assert names["train.recompute_granularity=none"].step_ratio == pytest.approx(3 / 4)  # no 4/3 forward
    _, bare = _plan([*exp, "train.recompute_granularity=none", "optim.distributed=false"])
    assert not bare.memory.fits and [p.key for p in bare.problems if p.code == "memory"]


def test_llama_1b_plan_counts_its_architecture():
    """The Llama 1B example: parameters, FLOPs and activations follow GQA, SwiGLU, rope and RMSNorm (not
    a GPT of the same width), and the dry run prints them."""
    from trainer import formulas

    cfg, plan = _plan(["+experiment=llama_1b"], PlanInputs("r", "/runs/r", vocab_from_file=32768))
    m = cfg.model
    assert (m.query_groups, m.activation, m.ffn_hidden_size) == (8, "swiglu", 8192)
    gpt = dataclasses.replace(m, num_query_groups=None, activation="gelu", ffn_hidden_size=4 * 2048,
                              position_embedding="learned", normalization="layernorm", add_bias_linear=True)
    # 1,235,814,400 with Llama 3's 128,256-token vocabulary (tests/model/test_counts.py); here 32,768.
    assert plan.memory.params == 1_235_814_400 - (128256 - 32768) * 2048
    assert plan.memory.params != formulas.stage_params(gpt, 32768)[0]
    assert plan.time.flops_per_iter == formulas.model_flops_per_iteration(m, 512, 32768)
    assert plan.time.flops_per_iter != formulas.model_flops_per_iteration(gpt, 512, 32768)
    text = format_plan(cfg, plan, {})
    assert "1040.25 M" in text and f"{plan.time.flops_per_iter / 1e12:.1f} TFLOP per iteration" in text


def test_mfu_uses_the_detected_gpu_unless_the_user_sets_a_peak(monkeypatch):
    """The plan's peak (312, cluster/slurm.yaml's A100 in the device table) is the plan's estimate only: it
    once went into the trainer's logging.peak_tflops, which overrides the GPU detection, so every log
    line on an H100/H200 node said MFU 3.2x too high."""
    import torch

    from trainer.config import RunConfig
    from trainer.run.metrics import detect_peak_tflops

    cfg, plan = _plan(["+experiment=codeparrot", "cluster=slurm"])
    assert cfg.cluster.gpus_per_node and hardware(cfg).peak_tflops.value == 312.0  # the A100's, by its table
    rc = RunConfig.from_dict(plan.stage("train").job.trainer_config)
    assert rc.logging.peak_tflops is None
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert detect_peak_tflops(torch.device("cuda", 0), rc.logging.peak_tflops) == 989.0
    _, plan = _plan(["+experiment=codeparrot", "cluster=slurm", "logging.peak_tflops=400"])
    rc = RunConfig.from_dict(plan.stage("train").job.trainer_config)
    assert detect_peak_tflops(torch.device("cuda", 0), rc.logging.peak_tflops) == 400.0


@pytest.mark.parametrize("model_vocab", [None, 50304])
def test_the_plan_sizes_the_vocabulary_the_trainer_builds(tmp_path, model_vocab):
    """model.vocab_size wins over the tokenizer's entries in the trainer (trainer.run.data.resolve_vocab);
    the plan's parameter count, memory and FLOPs use the same number."""
    import json

    from trainer.config import ModelConfig, TokenizerConfig
    from trainer.run.data import resolve_vocab

    vocab_file = tmp_path / "vocab.json"
    vocab_file.write_text(json.dumps({f"t{i}": i for i in range(32768)}))
    over = [] if model_vocab is None else [f"model.vocab_size={model_vocab}"]
    cfg, plan = _plan(CP + over, PlanInputs("r", "/runs/r", vocab_from_file=32768))
    tok = TokenizerConfig(vocab_file=str(vocab_file), merge_file=str(vocab_file))
    built, _ = resolve_vocab(ModelConfig(**{**dataclasses.asdict(cfg.model)}), tok)
    assert built == (model_vocab or 32768)
    assert plan.vocab_size == built


def test_no_data_at_all_is_a_plan_problem_not_a_crash(tmp_path):
    """Every stage plans from an empty input list (the train stage's tokenizer files, the eval stage's
    held-out prefix) so the launch can say what is missing."""
    result = launch(compose_cfg(["+experiment=codeparrot_smoke", "data.corpus=null", f"runs_root={tmp_path}",
                                 "dry_run=true"]), out=io.StringIO())
    assert {p.code for p in result.plan.problems} == {"data_missing", "tokenizer_missing"}
    assert result.plan.stage("eval").job.heldout_prefix is None


def test_an_uneven_pipeline_split_plans_and_sizes_its_busiest_stage():
    """Megatron's uneven split (parallel.first_stage_layers): 13 layers do not split evenly over 4 stages,
    1 + 4 + 4 + 4 and 4 + 3 + 3 + 3 do. Memory follows the busiest stage: stage r keeps p − r micro-batches
    in flight, so 4 + 3 + 3 + 3 holds 4 layers × 4 on the first stage (16 layer-micro-batches, vs 3 × 4 at
    the even 12-layer split), while with 1 + 4 + 4 + 4 the busiest is the second (4 × 3 = 12) and the
    last stage, not the first, holds the most parameters."""
    from orchestrator.base.plan_types import Context
    from orchestrator.checks import run_checks

    def cfg(*o: str):
        return compose_cfg(CP + ["parallel.pp_size=4", *o])

    def codes(c) -> set[str]:
        return {p.code for p in run_checks(Context(c, exists=lambda p: True), at="plan")}

    light, heavy = cfg("model.num_layers=13", "parallel.first_stage_layers=1"), cfg(
        "model.num_layers=13", "parallel.first_stage_layers=4")
    assert not {"pp_layers", "uneven_pp", "vpp_layers"} & (codes(light) | codes(heavy))
    assert "pp_layers" in codes(cfg("model.num_layers=13"))
    base = estimate_memory(cfg(), 32768, layout_of(cfg())).activations_bytes
    assert estimate_memory(light, 32768, layout_of(light)).activations_bytes == base
    assert estimate_memory(heavy, 32768, layout_of(heavy)).activations_bytes == base * 16 // 12
    per_layer = stage_params(compose_cfg(CP + ["model.num_layers=13"]), 32768)[1] - stage_params(
        compose_cfg(CP), 32768)[1]
    assert stage_params(light, 32768)[0] == 4 * per_layer + 32768 * 768 + 2 * 768  # head copy, final norm


# --- issue 52 item 9: W&B in the plan -------------------------------------------------------------------

def _wandb_text(overrides, environ, sweep=None):
    cfg = compose_cfg(overrides)
    plan = make_plan(cfg, PlanInputs("r7", "/runs/r7", environ=environ, sweep=sweep), exists=lambda p: True)
    text = format_plan(cfg, plan, {})
    return text[text.index("  W&B:"):].split("\n\n")[0]


def test_the_plan_says_where_wandb_logs_and_where_its_key_comes_from(tmp_path):
    """Mode, project, entity, group (a sweep's id) and run name as the training job gets them, and where the
    API key comes from: the variable or the netrc file by name, never the key."""
    from orchestrator.base.facts import SweepInfo

    key = "f" * 40
    text = _wandb_text(["+experiment=codeparrot", "logging.wandb.entity=myteam"], {"WANDB_API_KEY": key})
    assert "W&B: online, project codeparrot, entity myteam, group (none), run r7" in text, text
    assert "API key: WANDB_API_KEY of the launching environment" in text and key not in text
    netrc = tmp_path / "netrc"
    netrc.write_text(f"machine api.wandb.ai\n  login user\n  password {key}\n")
    text = _wandb_text(["+experiment=codeparrot"], {"NETRC": str(netrc)})
    assert f"API key: netrc file {netrc} (wandb login)" in text and key not in text, text
    text = _wandb_text(["+experiment=codeparrot"], {"NETRC": str(tmp_path / "none")})
    assert "API key: none found" in text
    sweep = SweepInfo("20261202-162750", str(tmp_path / "sweep"), 1, ("optim.lr=1e-4",))
    text = _wandb_text(["+experiment=codeparrot", "optim.lr=1e-4"], {"WANDB_API_KEY": key}, sweep)
    assert "group 20261202-162750, run r7:optim.lr=1e-4" in text, text
    text = _wandb_text(["+experiment=codeparrot_smoke"], {})  # the smoke run logs offline
    assert "W&B: offline, project slipway" in text and "files under /runs/r7/wandb" in text
    assert "API key" not in text
    assert _wandb_text(["+experiment=codeparrot_smoke", "logging.wandb.mode=disabled"], {}) == \
        "  W&B: disabled (logging.wandb.mode)"


# --- issue 52 item 10: precision notes, from the one table of facts and bench/'s measurements -----------

def test_fp16_on_a_bf16_device_gets_a_note_and_an_unmeasured_recipe_says_so(tmp_path):
    from orchestrator.base.measured import measured_recipes
    from orchestrator.planning.plan_format import precision_notes
    from tests.orchestrator.sites import H100_X4, site_file
    from trainer.measured import load_measured

    h100 = site_file(tmp_path, "mysite", H100_X4)
    cfg, plan = _plan(["+experiment=codeparrot", *h100], PlanInputs("r", "/runs/r", environ={}))
    notes = " ".join(precision_notes(cfg))
    assert "fp16 is the usual choice on GPUs without bf16" in notes and "H100-SXM-80GB has bf16" in notes
    assert "train.precision=bf16" in notes and "note: fp16" in format_plan(cfg, plan, {})
    bf16, _ = _plan(["+experiment=codeparrot", *h100, "train.precision=bf16"], PlanInputs("r", "/runs/r"))
    assert precision_notes(bf16) == []  # autocast measured, bf16 chosen: nothing to say
    v100 = site_file(tmp_path, "old", H100_X4.replace("H100-80GB", "V100\ndevice_bf16: false\n"
                                                       "device_memory_gb: 32\ndevice_peak_tflops: 125"))
    old, _ = _plan(["+experiment=codeparrot", *v100], PlanInputs("r", "/runs/r"))
    assert precision_notes(old) == []  # fp16 is the choice there
    cpu, _ = _plan(["+experiment=codeparrot_smoke"], PlanInputs("r", "/runs/r"))
    assert precision_notes(cpu) == []
    # The distributed optimizer's default recipe: what bench/results/mfu.json holds decides the note.
    assert measured_recipes() == {r.recipe for r in load_measured()}
    big, plan = _plan(["+experiment=gpt_1p3b", *h100], PlanInputs("r", "/runs/r"))
    notes = " ".join(precision_notes(big))
    assert "master_weights recipe has not been measured on a GPU yet" in notes
    assert "master_weights recipe" in format_plan(big, plan, {})
    assert precision_notes(big, frozenset({"autocast", "master_weights"})) == []
