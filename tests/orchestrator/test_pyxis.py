"""container=pyxis (NVIDIA's pyxis/enroot srun plugin): the srun flags of the rendered job scripts, what
reaches the container when those scripts run (a stand-in srun prints its arguments and environment), and
every plan-time check. pyxis cannot be installed here; that the flags start a container is not tested.
"""

from __future__ import annotations

import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.base.plan_types import Context
from orchestrator.checks import run_checks
from orchestrator.checks.container import pyxis_problems
from orchestrator.launch.flow import scripts_of
from orchestrator.launch.submit import render_stage
from orchestrator.planning.plan import PlanInputs, make_plan
from orchestrator.stages.tune import NAME as TUNE
from orchestrator.world.container import PYXIS_OPTIONS, REGISTRY_REF
from orchestrator.world.runs import REPO_ROOT
from tests.orchestrator.conftest import REPO, compose_cfg, stage_names, user_docs
from tests.orchestrator.test_secrets import ENV_SECRETS

SQSH = (Path(__file__).parent / "images" / "tiny.sqsh").read_bytes()  # by mksquashfs (test_image_files.py)
PYXIS_HELP = "".join(f"      {o}=ARG   [pyxis] ...\n" for o in PYXIS_OPTIONS)


def _cfg(tmp_path: Path, *extra: str, cluster: str = "devcluster"):
    image = tmp_path / "slipway.sqsh"
    image.write_bytes(SQSH)
    return compose_cfg(["+experiment=codeparrot_smoke", f"cluster={cluster}", "container=pyxis",
                        f"runs_root={tmp_path}/runs", f"cache_dir={tmp_path}/cache",
                        f"container.image={image}", *extra])


def _plan(cfg, tmp_path: Path):
    return make_plan(cfg, PlanInputs("r1", f"{tmp_path}/runs/x/r1"))


def _problems(cfg, tmp_path: Path) -> dict[str, list]:
    out: dict[str, list] = {}
    for p in _plan(cfg, tmp_path).problems + run_checks(Context(cfg), "inputs", at="launch"):
        out.setdefault(p.code, []).append(p)
    return out


def _script(cfg, tmp_path: Path, stage: str) -> str:
    plan = _plan(cfg, tmp_path)
    return render_stage(cfg, plan, plan.stage(stage), ("1",))


def _srun_words(script: str) -> list[str]:
    line = next(ln for ln in script.replace("\\\n", " ").splitlines() if ln.strip().startswith("srun "))
    return shlex.split(line.replace('"$(slipway_container_env)"', "NAMES").rstrip("& "))


def _flags(words: list[str]) -> dict[str, str]:
    return dict(w.split("=", 1) if "=" in w else (w, "") for w in words if w.startswith("--"))


# ----- rendering ---------------------------------------------------------------------------------------


def test_every_srun_runs_in_the_image_with_the_job_folders_mounted(tmp_path, monkeypatch):
    launch = tmp_path / "launch"
    launch.mkdir()
    monkeypatch.chdir(launch)
    cfg = _cfg(tmp_path, f"container.binds=[{tmp_path}/extra]")
    for stage in stage_names(TUNE):
        words = _srun_words(_script(cfg, tmp_path, stage))
        flags = _flags(words)
        assert flags["--container-image"] == str(tmp_path / "slipway.sqsh"), stage
        mounts = flags["--container-mounts"].split(",")
        assert mounts == [str(REPO_ROOT), f"{tmp_path}/runs", f"{tmp_path}/cache", f"{tmp_path}/extra",
                          str(launch)], stage  # repository first; the launch directory last
        assert flags["--container-workdir"] == str(launch)  # relative paths resolve as on the host
        assert "--no-container-mount-home" in flags and flags["--container-env"] == "NAMES"
        assert words[-5:-1] == ["python", "-u", "-m", "submitit.core._submit"]  # the image's python
        assert {f for f in flags if "container" in f} == set(PYXIS_OPTIONS)  # what pyxis_problems checks
    assert "container_exec.sh" not in scripts_of(cfg, _plan(cfg, tmp_path))  # no Apptainer wrapper


def test_image_forms(tmp_path, monkeypatch):
    """A file is made absolute (the job may start elsewhere); a registry reference is passed unchanged,
    quoted (its "#" would start a comment at the start of a word)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "s.sqsh").write_bytes(SQSH)
    cfg = _cfg(tmp_path, "container.image=img/s.sqsh")
    image = _flags(_srun_words(_script(cfg, tmp_path, "train")))["--container-image"]
    assert image == f"{tmp_path}/img/s.sqsh"
    ref = "nvcr.io#nvidia/pytorch:24.12-py3"
    cfg = _cfg(tmp_path, f"container.image='{ref}'")
    script = _script(cfg, tmp_path, "train")
    assert f"'--container-image={ref}'" in script
    assert _flags(_srun_words(script))["--container-image"] == ref


# ----- what the container receives when the script runs ------------------------------------------------


def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


@pytest.mark.parametrize("stage", ["preprocess", "train"])
def test_container_env_names_the_allowlist_and_no_value_is_in_the_script(tmp_path, stage):
    """Run the rendered script with stand-ins for srun and scontrol: --container-env gets allowlisted
    names (evaluated when srun starts: the training loop's MASTER_PORT and SLIPWAY_ATTEMPT too), never a
    value; denylisted variables are unset before srun; secret values pass through the environment only."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, "srun", 'printf "%s\\n" "$@" > "$OUT/args"; env > "$OUT/env"\n')
    _fake(bin_dir, "scontrol", "echo node1\n")
    script = tmp_path / "job.sh"
    text = _script(_cfg(tmp_path), tmp_path, stage)
    script.write_text(text)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path), "SLURM_JOB_ID": "42",
           "SLURM_JOB_NODELIST": "node1", "NCCL_IB_HCA": "mlx5", "HF_TOKEN_PATH": "/home/me/.hf",
           "WANDB_DIR": "/home/me/wandb", "UNLISTED": "x", **ENV_SECRETS}
    res = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    args = (tmp_path / "args").read_text().splitlines()
    names = next(a for a in args if a.startswith("--container-env=")).split("=", 1)[1].split(",")
    assert {"PYTHONPATH", "SLURM_JOB_ID", "NCCL_IB_HCA", "WANDB_API_KEY", "SLIPWAY_RUN_ID"} <= set(names)
    assert not {"HF_TOKEN_PATH", "WANDB_DIR", "UNLISTED", "DB_PASSWORD", "SSH_KEY"} & set(names)
    if stage == "train":
        assert {"MASTER_ADDR", "MASTER_PORT", "SLIPWAY_ATTEMPT"} <= set(names)
    seen = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines() if "=" in line)
    assert "HF_TOKEN_PATH" not in seen and "WANDB_DIR" not in seen  # host files the image cannot read
    assert seen["PYTHONPATH"] == str(REPO_ROOT) and seen["WANDB_API_KEY"] == ENV_SECRETS["WANDB_API_KEY"]
    for value in ENV_SECRETS.values():
        assert value not in text and all(value not in a for a in args)


def test_dry_run_prints_and_writes_no_secret(tmp_path):
    """launch.py dry_run=true with container=pyxis, secrets in the launching environment and a stand-in
    srun that has pyxis: the job scripts are printed, no secret value is printed or written."""
    from tests.orchestrator.test_secrets import _leaks

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, "srun", f"cat <<'EOF'\n{PYXIS_HELP}EOF\n")
    _fake(bin_dir, "sinfo", "echo debug\n")  # a controller that answers, with or without the devcluster
    image = tmp_path / "s.sqsh"
    image.write_bytes(SQSH)
    env = dict(os.environ, **ENV_SECRETS, PATH=f"{bin_dir}:{os.environ['PATH']}")
    env.pop("HYDRA_FULL_ERROR", None)
    args = ["+experiment=codeparrot_smoke", "cluster=devcluster", "container=pyxis",
            f"container.image={image}", f"runs_root={tmp_path}/runs", "dry_run=true"]
    out = subprocess.run([sys.executable, str(REPO / "launch.py"), *args], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    stages = out.stdout.count(" job script -----")
    assert stages >= 4 and out.stdout.count('--container-env="$(slipway_container_env)"') == stages
    assert _leaks(tmp_path, out.stdout, out.stderr) == []


# ----- plan-time checks (checks/container.py: pure and inputs) -------------------------------------------


def test_a_clean_pyxis_config_has_no_problems(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _problems(_cfg(tmp_path), tmp_path) == {}


def test_local_executor_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    [p] = _problems(_cfg(tmp_path, cluster="local"), tmp_path)["container_local"]
    assert p.key == "container.kind" and p.value == "pyxis" and "container=none" in p.fix


def test_image_missing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    [p] = _problems(_cfg(tmp_path, "container.image=null"), tmp_path)["container_image"]
    assert p.key == "container.image" and "build_sqsh.sh" in p.fix
    [p] = _problems(_cfg(tmp_path, f"container.image={tmp_path}/nope.sqsh"), tmp_path)["file_missing"]
    assert p.key == "container.image" and p.value == f"{tmp_path}/nope.sqsh"


def test_image_that_is_not_squashfs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sif = tmp_path / "slipway-ngc.sif"
    sif.write_bytes(b"#!/usr/bin/env run-singularity\n" + bytes(64))
    [p] = _problems(_cfg(tmp_path, f"container.image={sif}"), tmp_path)["container_image_format"]
    assert p.key == "container.image" and p.value == str(sif) and "container=apptainer_ngc" in p.fix


GOOD_REFS = ["nvcr.io#nvidia/pytorch:24.12-py3", "docker://nvcr.io#nvidia/pytorch:24.12-py3", "ubuntu",
             "ubuntu:24.04", "me@nvcr.io#nvidia/pytorch:24.12-py3", "dockerd://slipway:dev",
             "registry.example.org:5000#team/slipway@sha256:" + "a" * 64, "nvcr.io/nvidia/pytorch:24.12-py3"]
BAD_REFS = ["podman://ubuntu", "nvcr.io#NVIDIA/PyTorch:24.12", "nvcr.io#nvidia/pytorch:24.12 py3",
            "nvcr.io##nvidia/pytorch", "ubuntu:"]


@pytest.mark.parametrize("ref", GOOD_REFS)
def test_registry_references_pyxis_reads(ref):
    assert REGISTRY_REF.fullmatch(ref)


@pytest.mark.parametrize("ref", BAD_REFS)
def test_malformed_registry_reference(tmp_path, monkeypatch, ref):
    monkeypatch.chdir(tmp_path)
    [p] = _problems(_cfg(tmp_path, f"container.image='{ref}'"), tmp_path)["container_image_uri"]
    assert p.key == "container.image" and p.value == ref and "[USER@][REGISTRY#]IMAGE[:TAG]" in p.message


def test_credentials_in_the_reference_are_refused_and_not_shown(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(tmp_path, "container.image='me:pw-hunter22@nvcr.io#nvidia/pytorch:24.12-py3'")
    [p] = _problems(cfg, tmp_path)["container_image_credentials"]
    assert p.key == "container.image" and "pw-hunter22" not in str(p) and ".credentials" in p.fix


@pytest.mark.parametrize("override,key", [
    ("runs_root='/shared/a,b'", "runs_root"),
    ("cache_dir=/shared/c:d", "cache_dir"),
    ("runs_root='/shared/my runs'", "runs_root"),  # pyxis < 0.24 splits its mount table on white space
    ("container.binds=[/usr]", "container.binds"),
])
def test_folders_pyxis_cannot_mount(tmp_path, monkeypatch, override, key):
    monkeypatch.chdir(tmp_path)
    [p] = _problems(_cfg(tmp_path, override), tmp_path)["container_mount"]
    assert p.key == key and p.fix


def test_launching_from_a_system_folder(tmp_path, monkeypatch):
    """The launch directory is the container's working directory, so it is mounted: never over /usr."""
    cfg = _cfg(tmp_path)
    monkeypatch.chdir("/usr")
    [p] = _problems(cfg, tmp_path)["container_mount"]
    assert p.key == "(the launch directory)" and p.value == "/usr"


def test_apptainer_binds_paths_with_spaces_but_not_commas(tmp_path):
    cfg = compose_cfg(["+experiment=codeparrot_smoke", "container=apptainer_ngc",
                       f"runs_root='{tmp_path}/my runs'", f"cache_dir='{tmp_path}/a,b'"])
    [p] = [p for p in make_plan(cfg, PlanInputs("r1", "/r/r1"), exists=lambda p: True).problems
           if p.code == "container_mount"]
    assert p.key == "cache_dir"


# ----- srun has pyxis (checks/container.py: world) ----------------------------------------------------


@pytest.mark.parametrize("help_text,message", [
    (PYXIS_HELP, None),
    ("Usage: srun [OPTIONS(0)...]\n  --chdir=path\n", "pyxis is not loaded here"),
    (PYXIS_HELP.replace("--container-env", "--container-save"), "does not list --container-env"),
])
def test_srun_must_list_the_pyxis_options(tmp_path, monkeypatch, help_text, message):
    _fake(tmp_path, "srun", f"cat <<'EOF'\n{help_text}EOF\n")
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    problems = pyxis_problems(Context(_cfg(tmp_path)))
    assert [p.code for p in problems] == ([] if message is None else ["pyxis_missing"])
    if message:
        assert problems[0].key == "container.kind" and message in problems[0].message and problems[0].fix


def test_launch_refuses_when_srun_has_no_pyxis(tmp_path, monkeypatch):
    """The launch asks srun (flow.py), and refuses before anything is written or submitted."""
    from orchestrator.base.problems import PlanError
    from orchestrator.launch.flow import launch

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, "srun", "echo 'Usage: srun [OPTIONS(0)...]'\n")
    _fake(bin_dir, "sinfo", "echo debug\n")  # a controller that answers, with or without the devcluster
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    cfg = _cfg(tmp_path)
    with pytest.raises(PlanError) as err:
        launch(cfg, out=io.StringIO())
    assert [p.code for p in err.value.problems] == ["pyxis_missing"]
    assert not (tmp_path / "runs").exists()


def test_no_srun_on_path(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    [p] = pyxis_problems(Context(cfg))
    assert p.code == "pyxis_missing" and "not on this node's PATH" in p.message


def test_srun_is_asked_only_for_pyxis_on_slurm(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert pyxis_problems(Context(_cfg(tmp_path, cluster="local"))) == []  # container_local says so
    assert pyxis_problems(Context(compose_cfg(["+experiment=codeparrot_smoke", "cluster=devcluster"]))) == []


def test_readme_and_containers_readme_describe_pyxis():
    text = user_docs() + (REPO / "containers" / "README.md").read_text()
    for needle in ("container=pyxis", "--container-env", "build_sqsh.sh"):
        assert needle in text, needle
    assert re.search(r"pyxis.*not (been )?(run|tested)", text, re.S)  # says what is not tested here
