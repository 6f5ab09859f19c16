"""The site's hardware wins (issue 37, items 1 and 2): a site file states the hardware, an experiment asks
for a size; the plan prints every hardware value with its source and refuses what the site cannot give;
device facts come from the device table, the ETA from the MFU measured in bench/ plus the data-parallel
exchange."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from orchestrator.base.estimate import GIB
from orchestrator.planning.plan import PlanInputs, make_plan
from orchestrator.planning.plan_format import format_plan
from tests.orchestrator.conftest import REPO, compose_cfg
from tests.orchestrator.sites import H100_X4, H100_X4_LIMITS, site_file

KEY = {"WANDB_API_KEY": "k" * 40}


def _plan(overrides):
    cfg = compose_cfg(overrides)
    return cfg, make_plan(cfg, PlanInputs("r", "/runs/r", environ=KEY), exists=lambda p: True)


def _codes(plan):
    return sorted({p.code for p in plan.problems})


def test_launch_renders_the_sites_gpus_per_node_not_the_experiments(tmp_path):
    """`+experiment=codeparrot cluster=<4-GPU site>` once rendered --gpus-per-node=8: launch.py, the real
    entry point, now asks for the site's 4 GPUs on 2 nodes (the experiment's 8 GPUs)."""
    over = site_file(tmp_path, "mysite", H100_X4)
    out = subprocess.run([sys.executable, "launch.py", "+experiment=codeparrot", *over, "dry_run=true",
                          f"runs_root={tmp_path}/runs"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={**os.environ, **KEY})
    train = out.stdout.split("----- train job script -----")[1]
    assert "#SBATCH --gpus-per-node=4" in train and "#SBATCH --nodes=2" in train, out.stdout + out.stderr
    assert "#SBATCH --ntasks-per-node=4" in train
    assert re.search(r"GPUs per node +4 +site file cluster/mysite\.yaml", out.stdout), out.stdout
    assert re.search(r"nodes +2 +cluster\.gpus=8 \(experiment codeparrot\) / 4 GPUs per node", out.stdout), \
        out.stdout


@pytest.mark.parametrize("experiment", ["llama_1b", "gpt_1p3b", "codeparrot"])
def test_experiments_keep_the_sites_device(tmp_path, experiment):
    """llama_1b and gpt_1p3b once replaced the site's device name and memory (40 GB next to a 989 TFLOP/s
    peak); the plan now checks memory against the site's device, 80 GB here."""
    cfg, plan = _plan([f"+experiment={experiment}", *site_file(tmp_path, "mysite", H100_X4)])
    assert cfg.cluster.device_name == "H100-80GB" and cfg.cluster.gpus_per_node == 4
    assert plan.memory.device_bytes == 80 * GIB
    assert cfg.cluster.nodes * cfg.cluster.gpus_per_node == {"gpt_1p3b": 16}.get(experiment, 8)
    text = format_plan(cfg, plan, {})
    assert "device (H100-80GB)" in text and "A100" not in text.split("Stages:")[0]


def test_an_experiment_that_states_hardware_is_overruled_and_the_plan_says_so(tmp_path):
    """A user's experiment setting hardware: the site's values stand, each source names what was not used."""
    over = site_file(tmp_path, "mysite", H100_X4)
    exp = tmp_path / "site-conf" / "experiment"
    exp.mkdir(parents=True)
    (exp / "mine.yaml").write_text("# @package _global_\ndefaults:\n  - codeparrot\n  - _self_\n"
                                   "experiment: mine\ncluster:\n  gpus_per_node: 8\n"
                                   "  device_name: A100-40GB\n  device_memory_gb: 40\n"
                                   "  device_peak_tflops: 312\n")
    cfg, plan = _plan(["+experiment=mine", *over])
    c = cfg.cluster
    assert (c.gpus_per_node, c.device_name, c.device_memory_gb, c.device_peak_tflops) == (4, "H100-80GB",
                                                                                          None, None)
    assert plan.memory.device_bytes == 80 * GIB
    text = format_plan(cfg, plan, {})
    assert "site file cluster/mysite.yaml (experiment mine's 8 not used: hardware is the site's)" in text
    assert "experiment mine's 40.0 not used" in text and "experiment mine's 312.0 not used" in text


def test_every_hardware_value_is_printed_with_its_source(tmp_path):
    over = site_file(tmp_path, "mysite", H100_X4_LIMITS + "bus_bandwidth_gbps: 50\n")
    cfg, plan = _plan(["+experiment=codeparrot", *over, "cluster.nodes=1", "cluster.cpus_per_task=8"])
    text = format_plan(cfg, plan, {})
    hw = text.split("Hardware (")[1].split("Memory per device")[0]
    for row in (r"nodes +1 \(of 2\) +command line", r"GPUs per node +4 +site file cluster/mysite\.yaml",
                r"CPUs per node +64 +site file", r"device +H100-80GB = H100-SXM-80GB +site file",
                r"device memory +80 GB +device table: NVIDIA H100 Tensor Core GPU datasheet",
                r"peak \(fp16\) +989 TFLOP/s +device table: NVIDIA H100",
                r"bus bandwidth +50 GB/s +site file", r"MFU for the ETA +27\.3% +measured on H200"):
        assert re.search(row, hw), f"{row!r} not in\n{hw}"
    # cluster.nodes from the command line replaced the experiment's cluster.gpus
    assert cfg.cluster.gpus is None and "replaced by cluster.nodes from the command line" in \
        cfg.cluster.hardware_sources["gpus"]


@pytest.mark.parametrize("site,override,code,key,fix", [
    (H100_X4, "cluster.gpus_per_node=8", "site_hardware", "cluster.gpus_per_node",
     "cluster.gpus=8 (2 nodes of 4)"),
    (H100_X4, "cluster.device_name=A100-40GB", "site_hardware", "cluster.device_name", "another site"),
    (H100_X4_LIMITS, "cluster.gpus=16", "max_nodes", "cluster.gpus", "cluster.gpus=8, at most the site's"),
    (H100_X4, "cluster.gpus=6", "gpus", "cluster.gpus", "cluster.gpus=4 or cluster.gpus=8"),
    (H100_X4_LIMITS, "cluster.cpus_per_task=32", "node_cpus", "cluster.cpus_per_task",
     "cluster.cpus_per_task=16"),
    (H100_X4_LIMITS, "cluster.stage_cpus=128", "node_cpus", "cluster.stage_cpus", "cluster.stage_cpus=64"),
    (H100_X4_LIMITS + "mem_per_node_gb: 512\n", "cluster.mem_gb=1024", "node_memory", "cluster.mem_gb",
     "cluster.mem_gb=0 (all of a node's memory) or a value within it"),
])
def test_a_request_the_site_cannot_meet_is_refused_with_its_fix(tmp_path, site, override, code, key, fix):
    _, plan = _plan(["+experiment=codeparrot", *site_file(tmp_path, "mysite", site), override])
    found = [p for p in plan.problems if p.code == code]
    assert found and found[0].key == key and fix in found[0].fix, [str(p) for p in plan.problems]


def test_asking_less_than_the_site_has_is_a_request_not_a_problem(tmp_path):
    cfg, plan = _plan(["+experiment=codeparrot", *site_file(tmp_path, "mysite", H100_X4_LIMITS),
                       "cluster.gpus=4"])
    assert (cfg.cluster.nodes, plan.layout.world) == (1, 4) and plan.problems == []


def test_a_site_file_extending_another_keeps_its_settings(tmp_path):
    """docs/cluster.md's site file starts from slurm.yaml (defaults list): its NCCL settings and stage time
    limit stay, its device is overruled by the site's own line."""
    over = site_file(tmp_path, "ext", "defaults:\n  - slurm\n  - _self_\ngpus_per_node: 4\n"
                                      "device_name: H200\nenv: {NCCL_SOCKET_IFNAME: ib0}\n")
    cfg, plan = _plan(["+experiment=codeparrot", *over])
    c = cfg.cluster
    assert c.env["NCCL_DEBUG"] == "WARN" and c.env["NCCL_SOCKET_IFNAME"] == "ib0"
    assert c.stage_time_limit_min == 240 and (c.nodes, c.gpus_per_node) == (2, 4)
    assert plan.memory.device_bytes == 141 * GIB
    assert c.hardware_sources["device_name"] == "site file cluster/ext.yaml"


def test_without_a_view_of_the_site_file_nothing_is_overruled(tmp_path):
    """A site file Hydra cannot compose alone (a launch from another config directory, without the probe
    config): the composition stands as it is, and every source says why there is no site view."""
    from hydra import compose, initialize_config_dir

    from orchestrator.base.site import apply_site

    over = site_file(tmp_path, "mysite", H100_X4)
    with initialize_config_dir(config_dir=str(REPO / "hydra_conf"), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=codeparrot", *over])
        done = apply_site(cfg, {"cluster": "mysite", "experiment": "codeparrot"}, [])  # no search path
    c = done.cluster
    assert (c.gpus_per_node, c.device_name, c.nodes) == (4, "H100-80GB", 2)
    assert c.hardware_sources["device_name"] == "config (the site file could not be composed alone)"
    assert dict(c.site_hardware) == {}


# --- item 2: device facts from the device -------------------------------------------------------------

def test_the_device_table_finds_site_and_torch_spellings_and_names_its_datasheet():
    from trainer.devices import KNOWN_GPUS, find_gpu

    expect = {  # name as a site file or torch.cuda.get_device_name spells it → (entry, GB, 16-bit peak)
        "H100-80GB": ("H100-SXM-80GB", 80, 989), "NVIDIA H100 80GB HBM3": ("H100-SXM-80GB", 80, 989),
        "NVIDIA H100 PCIe": ("H100-PCIe-80GB", 80, 756), "NVIDIA H100 NVL": ("H100-NVL-94GB", 94, 835),
        "NVIDIA H200": ("H200-SXM-141GB", 141, 989), "NVIDIA GH200 480GB": ("GH200-96GB", 96, 989),
        "NVIDIA GH200 144G HBM3e": ("GH200-144GB", 144, 989), "NVIDIA A100-SXM4-40GB": ("A100-40GB", 40, 312),
        "NVIDIA A100 80GB PCIe": ("A100-80GB", 80, 312), "a100-80gb": ("A100-80GB", 80, 312),
        "NVIDIA B200": ("B200-180GB", 180, 2250), "NVIDIA L40S": ("L40S-48GB", 48, 362.05),
    }
    for name, (entry, gb, peak) in expect.items():
        gpu = find_gpu(name)
        assert gpu is not None and (gpu.name, gpu.memory_gb, gpu.tflops_16bit) == (entry, gb, peak), name
    for unknown in ("A100", "X100-80GB", "NVIDIA GB200", "cpu", ""):  # A100 alone: which memory?
        assert find_gpu(unknown) is None, unknown
    assert all("datasheet" in g.source or "specifications" in g.source for g in KNOWN_GPUS)


def test_the_trainers_mfu_uses_the_same_table(monkeypatch):
    """One table: the H100 PCIe card's dense peak is 756, not the SXM part's 989 it once got by name."""
    import torch

    from trainer.run.metrics import detect_peak_tflops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert detect_peak_tflops(torch.device("cuda", 0), None) == 756.0
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L40S")
    assert detect_peak_tflops(torch.device("cuda", 0), None) == 362.05


def test_a_device_named_without_its_peak_takes_the_tables_not_a_cpus(tmp_path):
    """`device_name: H100-80GB` without a peak once planned at 0.05 TFLOP/s: an ETA of 1338 days and a fix
    "time_limit_min >= 25708"."""
    cfg, plan = _plan(["+experiment=codeparrot", *site_file(tmp_path, "mysite", H100_X4)])
    assert plan.problems == [], [str(p) for p in plan.problems]
    assert plan.time.eta_s < 24 * 3600  # 150k steps of CodeParrot-small on 8 H100s: hours
    assert "989 TFLOP/s per device" in format_plan(cfg, plan, {})


def test_an_unknown_gpu_without_a_peak_is_a_problem_with_a_fix_not_an_eta(tmp_path):
    site = H100_X4.replace("device_name: H100-80GB", "device_name: X100-80GB")
    cfg, plan = _plan(["+experiment=codeparrot", *site_file(tmp_path, "mysite", site)])
    found = [p for p in plan.problems if p.key == "cluster.device_name"]
    assert found and "device_peak_tflops" in found[0].fix and "H100-SXM-80GB" in found[0].fix
    assert "time_limit" not in _codes(plan)
    text = format_plan(cfg, plan, {})
    assert "\n  ETA" not in text and "Time: not estimated" in text
    # Given its peak and memory, an unlisted GPU plans like any other.
    site += "device_peak_tflops: 500\ndevice_memory_gb: 64\n"
    _, plan = _plan(["+experiment=codeparrot", *site_file(tmp_path, "mysite", site)])
    assert plan.problems == [] and plan.memory.device_bytes == 64 * GIB and plan.time.known


def test_the_eta_uses_the_mfu_measured_in_bench_and_says_which(tmp_path):
    """27.3 % MFU, CodeParrot-small bf16 on one H200 (bench/README.md), read from its results file."""
    from orchestrator.base.measured import measured_figures

    (fig,) = measured_figures()
    assert (fig.gpu, fig.precision, fig.mfu) == ("H200-SXM-141GB", "bf16", 0.273)
    assert f"MFU {fig.mfu:.1%}".replace("%", " %") in (REPO / "bench" / "README.md").read_text()
    assert (REPO / fig.source).is_file()
    h200 = H100_X4.replace("H100-80GB", "H200")
    cfg, plan = _plan(["+experiment=codeparrot", "train.precision=bf16", *site_file(tmp_path, "h200", h200)])
    text = format_plan(cfg, plan, {})
    # At micro-batch 64, where it was measured, the figure itself; at the guide's 12, the curve's share of it.
    _, at64 = _plan(["+experiment=codeparrot", "train.precision=bf16", *site_file(tmp_path, "h200", h200),
                     "train.global_batch_size=512", "train.micro_batch_size=64"])
    assert "at 27.3% MFU of 989 TFLOP/s" in format_plan(cfg, at64, {})
    assert (f"at {plan.time.mfu:.1%} MFU (27.3% × {plan.time.mfu / 0.273:.2f} at micro-batch 12 × 1024 "
            "tokens) of 989 TFLOP/s") in text
    assert "measured on H200-SXM-141GB (codeparrot_small bf16" in text and fig.source in text
    assert re.search(r"by micro-batch +half at 4,396 tokens +hidden 768, tp 1: x/\(x \+ half\) of 29\.8% MFU",
                     text) and "micro-batches 8, 16, 32, 64" in text
    # Another GPU: the H200's figure, named as such; a site's own figure wins.
    cfg, plan = _plan(["+experiment=codeparrot", *site_file(tmp_path, "mysite", H100_X4)])
    assert "measured on H200-SXM-141GB, none yet on H100-SXM-80GB" in format_plan(cfg, plan, {})
    cfg, plan = _plan(["+experiment=codeparrot", *site_file(tmp_path, "mysite", H100_X4 + "mfu: 0.35\n")])
    assert re.search(r"MFU for the ETA +35\.0% \(at saturation\) +site file", format_plan(cfg, plan, {}))


def test_the_eta_adds_the_data_parallel_exchange_at_the_sites_bus_bandwidth(tmp_path):
    """nccl-tests' bus bandwidth: an all-reduce of S bytes over n ranks takes S·2(n−1)/n / busbw; the
    gradients are fp32 (4 bytes per parameter); what backward does not hide adds to the step."""
    slow = site_file(tmp_path, "slow", H100_X4 + "bus_bandwidth_gbps: 1\n")
    cfg, plan = _plan(["+experiment=codeparrot", *slow, "parallel.overlap_grad_reduce=false"])
    params, dp = plan.memory.params, plan.layout.dp
    assert dp == 8 and plan.time.exchange_s == pytest.approx(params * 4 * 2 * 7 / 8 / 1e9)
    assert plan.time.exposed_s == plan.time.exchange_s  # nothing overlaps
    fast_site = site_file(tmp_path, "fast", H100_X4 + "bus_bandwidth_gbps: 1e6\n")
    _, fast = _plan(["+experiment=codeparrot", *fast_site, "parallel.overlap_grad_reduce=false"])
    assert plan.time.step_s - fast.time.step_s == pytest.approx(plan.time.exchange_s - fast.time.exchange_s)
    _, overlapped = _plan(["+experiment=codeparrot", *slow])  # the last micro-batch's backward hides some
    assert 0 < overlapped.time.exposed_s < overlapped.time.exchange_s
    _, one = _plan(["+experiment=codeparrot", *slow, "cluster.gpus=null", "cluster.nodes=1",
                    "train.global_batch_size=48"])
    assert one.layout.dp == 4 and one.time.exchange_s > 0
    text = format_plan(cfg, plan, {})
    assert f"data-parallel exchange {plan.time.exchange_s:.3g} s" in text and "at 1 GB/s" in text


# A site file written without `defaults: [slurm]` and without `executor: slurm`: it names Slurm's
# partition, account and QoS, and the schema's default executor, local, would run it on the login node.
NO_SLURM = H100_X4.replace("executor: slurm\n", "") + "account: proj_ml\nqos: high\n"


def test_a_site_file_without_the_slurm_executor_is_refused_naming_the_missing_key(tmp_path):
    """The codeparrot experiment on that site: 2 nodes of 4 GPUs. Once it planned cleanly but for
    `cluster.nodes=1` (the local executor's one machine); now the executor is refused, with the fix, and
    the node count is not (the root cause comes alone)."""
    cfg, plan = _plan(["+experiment=codeparrot", *site_file(tmp_path, "mysite", NO_SLURM)])
    assert cfg.cluster.executor == "local" and cfg.cluster.nodes == 2
    [p] = [p for p in plan.problems if p.key.startswith("cluster.executor") or p.code == "local_nodes"]
    assert p.code == "executor" and p.value == "local", p
    assert ("cluster.partition=gpu, cluster.stage_partition=cpu, cluster.account=proj_ml, cluster.qos=high"
            in p.message and "login node" in p.message), p
    assert "`defaults: [slurm, _self_]`" in p.fix and "`executor: slurm`" in p.fix and "nodes=1" not in p.fix
    assert "cluster/mysite.yaml" in p.message
    fixed = NO_SLURM + "executor: slurm\n"
    _, plan = _plan(["+experiment=codeparrot", *site_file(tmp_path, "mysite", fixed)])
    assert "executor" not in _codes(plan)
    _, plan = _plan(["+experiment=codeparrot_smoke", "cluster=local"])  # the local site names none of them
    assert "executor" not in _codes(plan)
