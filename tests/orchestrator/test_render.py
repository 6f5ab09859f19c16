"""Golden tests of the rendered job scripts (pure): local/devcluster/slurm × container none/apptainer, and
devcluster/slurm × pyxis (the local executor refuses pyxis: test_pyxis.py).

A golden file that is missing fails its test (it is never written and then compared with itself).
Regenerate after an intended change with ``SLIPWAY_UPDATE_GOLDEN=1 pytest tests/orchestrator/test_render.py``
(the only way these files are written) and review the diff.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from orchestrator import container_render
from orchestrator.base import redaction
from orchestrator.base.schema import ContainerConfig
from orchestrator.launch.submit import container_wrapper, render_stage
from orchestrator.planning.plan import PlanInputs, make_plan
from orchestrator.world.runs import REPO_ROOT
from tests.orchestrator.conftest import compose_cfg, group_options

GOLDEN = Path(__file__).parent / "golden"
CLUSTERS = [c for c in ("local", "devcluster", "slurm") if c in group_options("cluster")]
FIXED = ["runs_root=/shared/runs", "cache_dir=/shared/cache", "container.image=/shared/images/slipway.sif"]
CASES = [(c, k) for c in CLUSTERS for k in ("none", "apptainer_ngc", "charliecloud")] + [
    (c, "pyxis") for c in CLUSTERS if c != "local"]


# Paths with a space and non-ASCII characters: every rendered script must keep each one a single word.
ODD_ROOT = "/shared/my runs/ünïcode"
ODD = [f"runs_root='{ODD_ROOT}'", "cache_dir='/shared/ça che'", "container.image='/shared/my images/s.sif'"]


def _scripts(cluster: str, container: str, fixed: list[str] = FIXED, root: str = "/shared/runs") -> str:
    """The scripts of every stage, rendered in the repository (pyxis's working directory is the launch
    directory, shown as <repo>)."""
    exp = "codeparrot" if cluster == "slurm" else "codeparrot_smoke"
    if container == "pyxis":
        fixed = [f.replace(".sif", ".sqsh") for f in fixed]
    if container == "charliecloud":
        fixed = [f.replace(".sif", "") for f in fixed]
    cfg = compose_cfg([f"+experiment={exp}", f"cluster={cluster}", f"container={container}", *fixed])
    facts = PlanInputs("20250101-000000-abcdef", f"{root}/x/20250101-000000-abcdef")
    plan = make_plan(cfg, facts, exists=lambda p: True)
    ids = {"corpus": "1000", "preprocess": "1001", "train": "1002", "convert": "1003"}
    python = "/usr/bin/python3" if container == "none" else None
    parts, cwd = [], os.getcwd()
    os.chdir(REPO_ROOT)
    try:
        for s in plan.stages:
            deps = tuple(ids[d] for d in s.depends_on)
            parts.append(f"===== {s.name} =====\n" + render_stage(cfg, plan, s, deps, python=python))
    finally:
        os.chdir(cwd)
    wrapper = container_wrapper(cfg, plan)
    if wrapper:
        parts.append("===== container_exec.sh =====\n" + wrapper)
    return "".join(parts).replace(str(REPO_ROOT), "<repo>")


@pytest.mark.parametrize("cluster,container", CASES)
def test_golden(cluster, container):
    text = _scripts(cluster, container)
    path = GOLDEN / f"{cluster}_{container}.txt"
    if os.environ.get("SLIPWAY_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"golden file {path} is missing: write it with SLIPWAY_UPDATE_GOLDEN=1, review it"
    assert text == path.read_text(), f"rendered scripts changed; diff against {path}"


def _odd_scripts() -> str:
    return _scripts("slurm", "apptainer_ngc", ODD, ODD_ROOT)


def test_golden_paths_with_a_space_and_non_ascii():
    path = GOLDEN / "slurm_apptainer_ngc_odd_paths.txt"
    if os.environ.get("SLIPWAY_UPDATE_GOLDEN") == "1":
        path.write_text(_odd_scripts())
    assert path.exists(), f"golden file {path} is missing: write it with SLIPWAY_UPDATE_GOLDEN=1, review it"
    assert _odd_scripts() == path.read_text(encoding="utf-8"), f"rendered scripts changed; diff with {path}"


def test_paths_with_a_space_stay_one_shell_word(tmp_path):
    """bash parses every script, and each argument that holds a path holds all of it."""
    roots = (ODD_ROOT, "/shared/ça che", "$logs/")
    for name, body in re.findall(r"===== (\S+) =====\n(.*?)(?====== |\Z)", _odd_scripts(), re.S):
        script = tmp_path / f"{name}.sh"
        script.write_text(body.replace("<repo>", "/repo"))  # the goldens' placeholder
        res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert res.returncode == 0, (name, res.stderr)
        for line in body.replace("\\\n", " ").splitlines():
            if not line.strip().startswith(("srun ", "logs=")):
                continue
            words = shlex.split(line)
            if words[0].startswith("logs="):
                assert words[0] == f"logs={ODD_ROOT}/x/20250101-000000-abcdef/logs", line
                continue
            args = dict(zip(words, words[1:]))
            assert args["--output"].startswith(roots) and args["--error"].startswith(roots), line
            assert args["submitit.core._submit"].startswith(roots), line
            assert args["bash"] == f"{ODD_ROOT}/x/20250101-000000-abcdef/container_exec.sh", line


def test_every_golden_file_belongs_to_a_case():
    """A golden file without a case (a cluster preset renamed or removed) would go stale unnoticed."""
    cases = {f"{c}_{k}.txt" for c, k in CASES}
    cases.add("slurm_apptainer_ngc_odd_paths.txt")
    assert {p.name for p in GOLDEN.glob("*.txt")} == cases


def test_slurm_training_script_semantics():
    text = _scripts("slurm", "none")
    train = text.split("===== train =====")[1].split("=====")[0]
    assert "#SBATCH --signal=USR2@180" in train and "#SBATCH --requeue" in train
    assert "#SBATCH --dependency=afterok:1001" in train and "#SBATCH --kill-on-invalid-dep=yes" in train
    assert "#SBATCH --nodes=1" in train and "#SBATCH --ntasks-per-node=8" in train
    assert "#SBATCH --gpus-per-node=8" in train and "#SBATCH --exclusive" in train
    assert "srun --unbuffered --kill-on-bad-exit=1" in train
    assert "_r${restart}_a${attempt}_%t.out" in train  # restart count in log names
    assert 'scontrol requeue "$SLURM_JOB_ID"' in train and "trap " in train
    convert = text.split("===== convert =====")[1]
    assert "#SBATCH --dependency=afterok:1002" in convert and "--signal" not in convert


def test_container_command_and_allowlist():
    c = ContainerConfig(kind="apptainer", image="/img/s.sif")
    wrapper = container_render.render_container_wrapper(c, ["/data/cp", "/data/cp/tok", "/runs"], "/code")
    exec_line = [line for line in wrapper.splitlines() if line.startswith("exec ")][0]
    argv = shlex.split(exec_line)
    assert argv[:5] == ["exec", "apptainer", "exec", "$nv", "--cleanenv"]  # --nv: GPU jobs only (below)
    assert argv[5:7] == ["--bind", "/code,/data/cp,/runs"]  # a child of a bound dir is not bound twice
    assert argv[7:] == ["/img/s.sif", "$@"]
    for pattern in ("NCCL_*", "MASTER_*", "SLURM_*", "WANDB_*", "HF_*"):
        assert pattern in wrapper
    assert "APPTAINERENV_${name}" in wrapper
    assert (
        container_render.python_command(c, "/r/container_exec.sh", "/usr/bin/python3")
        == "bash /r/container_exec.sh python"
    )
    assert container_render.python_command(c, "/r/c.sh", "/usr/bin/python3", gpus=True) == (
        "bash /r/c.sh --nv python")
    charliecloud = ContainerConfig(kind="charliecloud", image="/img/s")  # GPUs: ch-fromhost, no flag
    assert container_render.python_command(charliecloud, "/r/c.sh", "/usr/bin/python3", gpus=True) == (
        "bash /r/c.sh python")
    assert container_render.python_command(ContainerConfig(), "/x", "/usr/bin/python3") == "/usr/bin/python3"


def test_container_wrapper_forwards_allowlist_only(tmp_path):
    """Run the wrapper with a fake apptainer that prints its environment: only allowlisted variables
    arrive as APPTAINERENV_*, secrets' files are dropped, values are never in the file."""
    fake = tmp_path / "apptainer"
    fake.write_text("#!/bin/bash\nenv | grep '^APPTAINERENV_' | sort\necho ARGS \"$@\"\n")
    fake.chmod(0o755)
    c = ContainerConfig(kind="apptainer", image="/img/s.sif", apptainer_bin=str(fake))
    script = tmp_path / "wrap.sh"
    script.write_text(container_render.render_container_wrapper(c, ["/runs"], "/code"))
    env = {
        "PATH": os.environ["PATH"],
        "SLURM_PROCID": "3",
        "NCCL_DEBUG": "INFO",
        "WANDB_API_KEY": "s3cr3tvalue",
        "HF_TOKEN_PATH": "/home/me/.hf",
        "HOME_SECRET": "nope",
        "MASTER_ADDR": "n1",
    }
    import subprocess

    out = subprocess.run(["bash", str(script), "--nv", "python", "-c", "1"], env=env, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    got = dict(re.findall(r"^APPTAINERENV_(\w+)=(.*)$", out.stdout, re.M))
    assert got["SLURM_PROCID"] == "3" and got["NCCL_DEBUG"] == "INFO" and got["MASTER_ADDR"] == "n1"
    assert got["WANDB_API_KEY"] == "s3cr3tvalue"  # forwarded through the environment only
    assert "HF_TOKEN_PATH" not in got and "HOME_SECRET" not in got
    assert "ARGS exec --nv --cleanenv --bind /code,/runs /img/s.sif python -c 1" in out.stdout
    assert "s3cr3tvalue" not in script.read_text()


def test_redact():
    text = "token abcd1234xyz here"
    assert redaction.redact(text, {"WANDB_API_KEY": "abcd1234xyz", "HOME": "here"}) == (
        "token <redacted:WANDB_API_KEY> here"
    )


def test_the_job_script_and_the_trainer_derive_the_same_master_port():
    """The sbatch script exports MASTER_PORT; the trainer run by hand under Slurm derives it: one rule
    (trainer.formulas.master_port), checked by running the script's line in bash."""
    from trainer.parallel.launch import dist_env

    line = next(ln for ln in _scripts("slurm", "none").splitlines() if ln.startswith("export MASTER_PORT="))
    for job in ("7", "123457", "40000"):
        out = subprocess.run(["bash", "-c", f"SLURM_JOB_ID={job}; {line}; echo $MASTER_PORT"],
                             capture_output=True, text=True, check=True).stdout
        env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": "n1"}
        assert int(out) == dist_env(env).master_port, (job, line)


def test_the_master_port_is_never_one_the_kernel_hands_out():
    """Every job id's port lies below this machine's ephemeral range, where any outgoing connection on the
    first node may hold it (CI lost a job to EADDRINUSE on 38028 when the span reached 40000)."""
    from trainer.formulas import PORT_SPAN, master_port

    lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = {master_port(job) for job in range(PORT_SPAN)}
    assert len(ports) == PORT_SPAN  # concurrent jobs with close ids get distinct ports
    assert max(ports) < lo or min(ports) > hi, (min(ports), max(ports), (lo, hi))


def test_a_master_port_in_cluster_env_wins_over_the_job_ids():
    """The way out when a site keeps a service on the formula's port: cluster.env.MASTER_PORT, which the
    training script keeps (run in bash) instead of overwriting it with the job id's."""
    cfg = compose_cfg(["+experiment=codeparrot", "cluster=slurm", "container=none", *FIXED,
                       "+cluster.env.MASTER_PORT=23456"])
    plan = make_plan(cfg, PlanInputs("20250101-000000-abcdef", "/shared/runs/x/r"), exists=lambda p: True)
    train = next(s for s in plan.stages if s.name == "train")
    script = render_stage(cfg, plan, train, (), python="/usr/bin/python3")
    lines = [ln for ln in script.splitlines() if "MASTER_PORT" in ln]
    out = subprocess.run(["bash", "-c", "SLURM_JOB_ID=4242; " + "; ".join(
        ln for ln in lines if ln.startswith("export")) + "; echo $MASTER_PORT"],
                         capture_output=True, text=True, check=True).stdout
    assert int(out) == 23456, lines
    assert not any("SLURM_JOB_ID %" in ln for ln in lines), lines


def _stage_scripts(*overrides: str, experiment: str = "codeparrot") -> dict[str, str]:
    cfg = compose_cfg([f"+experiment={experiment}", "cluster=slurm", "container=apptainer_ngc", *FIXED,
                       *overrides])
    plan = make_plan(cfg, PlanInputs("r1", "/shared/runs/x/r1"), exists=lambda p: True)
    return {s.name: render_stage(cfg, plan, s, ()) for s in plan.stages}


def _directive(script: str, name: str) -> str | None:
    found = re.search(rf"^#SBATCH --{name}=(\S+)$", script, re.M)
    return found.group(1) if found else None


def test_stage_jobs_ask_for_their_memory_and_only_gpu_jobs_for_nv():
    """Each single-task stage job asks for its own memory (the site's default memory per CPU is no
    measure of it): preprocessing 2 GB + 0.5 per data.workers, conversion by the model's size; one
    cluster.stage_mem_gb sets them all; training keeps cluster.mem_gb. Apptainer's --nv comes only with
    GPUs: training and eval.device=cuda, never the CPU stages."""
    scripts = _stage_scripts()
    mem = {name: _directive(text, "mem") for name, text in scripts.items()}
    assert mem == {"preprocess": "18G", "train": "0", "convert": "5G", "eval": "7G"}, mem  # 32 workers, 110M
    assert _directive(_stage_scripts("data.workers=8")["preprocess"], "mem") == "6G"
    big = _stage_scripts(experiment="gpt_1p3b")
    assert int(_directive(big["convert"], "mem")[:-1]) > 30  # 24 bytes x 1.3B parameters, and more
    fixed = {n: _directive(t, "mem") for n, t in _stage_scripts("cluster.stage_mem_gb=12").items()}
    assert fixed == {"preprocess": "12G", "train": "0", "convert": "12G", "eval": "12G"}, fixed
    for name, text in scripts.items():
        gpus = _directive(text, "gpus-per-node")
        assert ("container_exec.sh --nv python" in text) == bool(gpus), (name, gpus)
    assert _directive(scripts["eval"], "gpus-per-node") == "1"
    assert _directive(scripts["convert"], "gpus-per-node") is None
