"""The site's environment reaches every rank in every container runtime: each variable cluster.env names
(the site file's UCX_TLS, FI_PROVIDER, slurm.yaml's OMP_NUM_THREADS=1, one added on the command line)
arrives inside the image, beside the allowlist, while other host variables stay out and secret values stay
out of every file (orchestrator/container_render.py). Apptainer's --nv is given only to jobs that hold GPUs.

- Apptainer is not installable here (no Debian or PyPI package): its wrapper runs against a stand-in that
  does what ``apptainer exec --cleanenv`` does with the environment (only APPTAINERENV_* variables, their
  prefix removed, and ``--env`` pairs reach the command; apptainer's docs, "Environment and Metadata"),
  once here and once as the rendered job scripts on the devcluster.
- Charliecloud runs for real on the devcluster: the training job's script, 2 nodes x 2 ranks, each rank
  in the image (containers/dev_image.py) reporting its environment.
- pyxis: the rendered script runs with a stand-in srun here; on the devcluster where pyxis is installed.

The Slurm jobs run the rendered scripts of the plan with a probe as the per-task command (one short job
each, ~10 s), as tests/slurm/test_strict_cluster.py does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.launch import submit
from orchestrator.planning.plan import PlanInputs, make_plan
from orchestrator.render import render_sbatch
from tests.orchestrator.conftest import compose_cfg
from tests.orchestrator.sites import site_file
from tests.orchestrator.test_charliecloud import _image
from tests.orchestrator.test_pyxis import SQSH, _fake
from tests.orchestrator.test_secrets import ENV_SECRETS

# What the site file sets, and what the command line adds (+cluster.env.KEY=VALUE).
SITE_ENV = {"UCX_TLS": "rc", "FI_PROVIDER": "efa", "OMP_NUM_THREADS": "1"}
CLI_ENV = {"GLOO_SOCKET_IFNAME": "lo"}
NAMED = {**SITE_ENV, **CLI_ENV}


def _site(tmp_path: Path, base: str) -> list[str]:
    """A site file as docs/cluster.md writes one: the base site through its defaults list, plus env."""
    env = "".join(f"  {k}: '{v}'\n" for k, v in SITE_ENV.items())
    text = f"defaults:\n  - {base}\n  - _self_\nenv:\n{env}"
    return [*site_file(tmp_path, "envsite", text), *(f"+cluster.env.{k}={v}" for k, v in CLI_ENV.items())]


def _cfg(tmp_path: Path, base: str, container: str, *extra: str):
    return compose_cfg(["+experiment=codeparrot_smoke", *_site(tmp_path, base), f"container={container}",
                        f"runs_root={tmp_path}/runs", f"cache_dir={tmp_path}/cache", *extra])


# The per-task probe: where it runs and what it sees, one file per rank.
PROBE = """
import json, os, sys
row = {"env": dict(os.environ), "python": sys.executable}
with open(os.path.join(sys.argv[1], "rank%s.json" % os.environ.get("SLURM_PROCID", "0")), "w") as f:
    json.dump(row, f)
"""


def _stand_in_apptainer(tmp_path: Path) -> Path:
    """``apptainer exec [--nv] --cleanenv --bind PATHS IMAGE CMD...`` with --cleanenv's environment: only
    APPTAINERENV_* (prefix removed) and --env K=V reach CMD, PATH is the image's (here: this Python's
    folder first, standing in for the image's). It says whether it got --nv (APPTAINER_STANDIN_NV)."""
    path = tmp_path / "bin" / "apptainer"
    path.parent.mkdir(exist_ok=True)
    image_path = f"{Path(sys.executable).parent}:/usr/bin:/bin"
    path.write_text(f"""#!/bin/bash
[ "$1" = exec ] || {{ echo "stand-in apptainer: only exec" >&2; exit 64; }}; shift
keep=(); nv=0; clean=0
while [ $# -gt 0 ]; do case "$1" in
  --nv) nv=1; shift ;; --cleanenv) clean=1; shift ;; --bind) shift 2 ;; --env) keep+=("$2"); shift 2 ;;
  -*) echo "stand-in apptainer: unknown option $1" >&2; exit 64 ;;
  *) break ;; esac; done
[ "$clean" = 1 ] || {{ echo "stand-in apptainer: models --cleanenv only" >&2; exit 64; }}
image=$1; shift
for name in $(compgen -e); do
  case "$name" in APPTAINERENV_*) keep+=("${{name#APPTAINERENV_}}=${{!name}}") ;; esac
done
exec env -i PATH={image_path} APPTAINER_STANDIN_IMAGE="$image" APPTAINER_STANDIN_NV=$nv "${{keep[@]}}" "$@"
""")
    path.chmod(0o755)
    return path


def _env_exports(script: str) -> str:
    """The job script's own exports (what sbatch's batch shell has before srun), without the lines that
    ask Slurm (MASTER_ADDR)."""
    return "\n".join(ln for ln in script.splitlines() if ln.startswith("export ") and "$(" not in ln)


# What the submitting shell has beyond cluster.env: an allowlisted, an unlisted and a denylisted variable.
HOST = {"NCCL_IB_HCA": "mlx5", "HOME_SECRET": "nope", "HF_TOKEN_PATH": "/home/me/.hf", **ENV_SECRETS}


def _host_env(tmp_path: Path) -> dict[str, str]:
    return {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "SLURM_PROCID": "3", **HOST}


def _assert_named_arrive(env: dict[str, str], clean: bool = True) -> None:
    """The named variables with their values, the allowlist's, no denylisted one; with a clean
    environment (Apptainer, Charliecloud; not pyxis, which passes the host's) no other host variable."""
    assert {k: env.get(k) for k in NAMED} == NAMED, {k: env.get(k) for k in NAMED}
    assert env["SLURM_PROCID"] and env["NCCL_IB_HCA"] == "mlx5"  # the allowlist still works
    assert "HF_TOKEN_PATH" not in env
    assert "HOME_SECRET" not in env or not clean


def test_apptainer_forwards_every_variable_cluster_env_names(tmp_path, monkeypatch):
    """The rendered scripts' exports, then the wrapper as the CPU stage and the GPU training job call it,
    with the --cleanenv stand-in: every named variable arrives; --nv only for the job that holds GPUs."""
    monkeypatch.chdir(tmp_path)
    fake = _stand_in_apptainer(tmp_path)
    cfg = _cfg(tmp_path, "slurm", "apptainer_ngc", f"container.apptainer_bin={fake}",
               "container.image=/img/s.sif")
    plan = make_plan(cfg, PlanInputs("r1", f"{tmp_path}/runs/x/r1"), exists=lambda p: True)
    wrapper = tmp_path / "runs" / "x" / "r1" / "container_exec.sh"
    wrapper.parent.mkdir(parents=True)
    text = submit.container_wrapper(cfg, plan)
    wrapper.write_text(text)
    out = tmp_path / "out"
    for stage, nv in (("preprocess", "0"), ("train", "1")):
        job = submit.stage_job(cfg, plan, plan.stage(stage))
        script = render_sbatch(job.spec)
        out.mkdir(exist_ok=True)
        probe = f"{_env_exports(script)}\n{job.python} -c {shlex.quote(PROBE)} {out}\n"
        res = subprocess.run(["bash", "-c", probe], env=_host_env(tmp_path), capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0, res.stderr
        env = json.loads((out / "rank3.json").read_text())["env"]
        _assert_named_arrive(env)
        assert env["APPTAINER_STANDIN_NV"] == nv, (stage, job.python)  # --nv only where GPUs are
        assert env["WANDB_API_KEY"] == ENV_SECRETS["WANDB_API_KEY"]  # by the environment only
    for value in ENV_SECRETS.values():
        assert value not in text


def test_charliecloud_streams_every_variable_cluster_env_names(tmp_path, monkeypatch):
    """The --set-env stream the wrapper gives ch-run (a stand-in that prints it) holds the named variables
    with the host's values."""
    from orchestrator.world.runs import REPO_ROOT

    image = _image(tmp_path, str(REPO_ROOT))
    fake = tmp_path / "ch-run"
    fake.write_text('#!/bin/bash\nfor a in "$@"; do case "$a" in --set-env=*) cat "${a#--set-env=}" ;; '
                    "esac; done\n")
    fake.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(tmp_path, "devcluster", "charliecloud", f"container.image={image}",
               f"container.charliecloud_bin={fake}")
    wrapper = tmp_path / "container_exec.sh"
    wrapper.write_text(submit.container_wrapper(cfg, make_plan(cfg, PlanInputs("r1", f"{tmp_path}/r1"))))
    env = {**_host_env(tmp_path), **NAMED}
    res = subprocess.run(["bash", str(wrapper), "true"], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    streamed = dict(line.split("=", 1) for line in res.stdout.splitlines() if "=" in line)
    _assert_named_arrive(streamed)


def test_pyxis_names_every_variable_cluster_env_sets(tmp_path, monkeypatch):
    """The whole training script with a stand-in srun: the named variables reach the task and are named
    in --container-env (so the host's value wins over one the image sets)."""
    monkeypatch.chdir(tmp_path)
    image = tmp_path / "s.sqsh"
    image.write_bytes(SQSH)
    cfg = _cfg(tmp_path, "devcluster", "pyxis", f"container.image={image}")
    plan = make_plan(cfg, PlanInputs("r1", f"{tmp_path}/runs/x/r1"), exists=lambda p: True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, "srun", 'printf "%s\\n" "$@" > "$OUT/args"; env > "$OUT/env"\n')
    _fake(bin_dir, "scontrol", "echo node1\n")
    script = tmp_path / "job.sh"
    script.write_text(submit.render_stage(cfg, plan, plan.stage("train")))
    env = {**_host_env(tmp_path), "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path),
           "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node1"}
    res = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    args = (tmp_path / "args").read_text().splitlines()
    names = next(a for a in args if a.startswith("--container-env=")).split("=", 1)[1].split(",")
    assert set(NAMED) <= set(names), names
    seen = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines() if "=" in line)
    _assert_named_arrive(seen, clean=False)


# ----- on the devcluster ---------------------------------------------------------------------------------


def _run_job(cfg, tmp_path: Path, stage: str) -> list[dict]:
    """Submit the stage's rendered script with the probe as its per-task command; the rows of its ranks."""
    from tests.slurm_cli import sacct_final_state, slurm

    run_dir = tmp_path / "runs" / "x" / "r1"
    plan = make_plan(cfg, PlanInputs("r1", str(run_dir)), exists=lambda p: True)
    run_dir.mkdir(parents=True, exist_ok=True)
    wrapper = submit.container_wrapper(cfg, plan)
    if wrapper:
        (run_dir / "container_exec.sh").write_text(wrapper)
    job = submit.stage_job(cfg, plan, plan.stage(stage))
    out = tmp_path / f"ranks-{stage}"
    out.mkdir()
    out.chmod(0o777)
    spec = dataclasses.replace(job.spec, command=f"{job.python} -c {shlex.quote(PROBE)} {out}")
    Path(spec.log_dir).mkdir(parents=True, exist_ok=True)
    script = tmp_path / f"{stage}.sbatch"
    script.write_text(render_sbatch(spec))
    env = {**os.environ, **HOST}
    job_id = slurm("sbatch", "--parsable", f"--chdir={tmp_path}", str(script), env=env).strip().split(";")[0]
    state = sacct_final_state(job_id)
    logs = "\n".join(f"{p.name}: {p.read_text()[-2000:]}" for p in sorted(Path(spec.log_dir).glob("*")))
    assert state == "COMPLETED", f"{state}\n{logs}"
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


@pytest.mark.slurm
def test_charliecloud_every_rank_sees_the_site_env_on_the_devcluster(tmp_path, monkeypatch):
    """The training job's script (2 nodes x 2 ranks), each rank in the real image through ch-run."""
    from tests.orchestrator.test_container_pipeline import IMAGE_PYTHON, _dev_image

    image = _dev_image("charliecloud")
    code = tmp_path / "code"  # ch-run binds the repository onto a folder the image has: one under /tmp
    code.mkdir()
    monkeypatch.setattr(submit, "REPO_ROOT", code)
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(tmp_path, "devcluster", "charliecloud", f"container.image={image}")
    rows = _run_job(cfg, tmp_path, "train")
    assert len(rows) == 4, rows
    for row in rows:
        assert row["python"] == IMAGE_PYTHON  # inside the image
        _assert_named_arrive(row["env"])
    assert sorted(r["env"]["SLURM_PROCID"] for r in rows) == ["0", "1", "2", "3"]


@pytest.mark.slurm
def test_apptainer_scripts_on_the_devcluster_forward_the_site_env_and_nv_only_with_gpus(tmp_path,
                                                                                         monkeypatch):
    """Apptainer's rendered scripts on Slurm, with the --cleanenv stand-in: the preprocessing job on the
    cpu partition and the training job on the gpu partition (2 ranks, gres/gpu): every rank gets the
    named variables; only the training ranks ran with --nv."""
    monkeypatch.chdir(tmp_path)
    fake = _stand_in_apptainer(tmp_path)
    cfg = _cfg(tmp_path, "devcluster", "apptainer_ngc", f"container.apptainer_bin={fake}",
               "container.image=/img/s.sif", "cluster.gpus_per_node=2", "cluster.nodes=1",
               "cluster.tasks_per_node=2", "cluster.partition=gpu", "cluster.stage_partition=cpu",
               "train.precision=fp32", "cluster.backend=gloo")
    # The memory Slurm gave each job (MB): preprocessing's own figure, 2 + 0.5 GB per data.workers (here
    # 2); training's cluster.mem_gb (4).
    for stage, ranks, nv, mem in (("preprocess", 1, "0", "3072"), ("train", 2, "1", "4096")):
        rows = _run_job(cfg, tmp_path, stage)
        assert len(rows) == ranks, rows
        for row in rows:
            _assert_named_arrive(row["env"])
            assert row["env"]["APPTAINER_STANDIN_NV"] == nv, stage
            assert row["env"]["SLURM_MEM_PER_NODE"] == mem, stage


@pytest.mark.slurm
def test_pyxis_every_rank_sees_the_site_env_on_the_devcluster(tmp_path, monkeypatch):
    """Where the devcluster loads pyxis (slurm/devcluster_lib/pyxis.py): the training job's ranks in the
    squashfs image."""
    from tests.orchestrator.test_container_pipeline import _dev_image, _pyxis_loaded

    if not _pyxis_loaded():
        pytest.skip("pyxis and enroot are not installed on this machine (slurm/README.md)")
    image = _dev_image("pyxis")
    monkeypatch.chdir(tmp_path)
    extra = ["ENROOT_ALLOW_SUPERUSER=yes"] if os.geteuid() == 0 else []
    cfg = _cfg(tmp_path, "devcluster", "pyxis", f"container.image={image}",
               *(f"+cluster.env.{e}" for e in extra))
    rows = _run_job(cfg, tmp_path, "train")
    assert len(rows) == 4, rows
    for row in rows:
        _assert_named_arrive(row["env"])
