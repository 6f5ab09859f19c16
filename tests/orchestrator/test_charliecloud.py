"""container=charliecloud, without a cluster: the per-task wrapper (what reaches the image, run with a
stand-in ch-run that prints its arguments and the environment stream it is given) and the plan's checks
on the image folder (a root file system, a folder for every bind, the kernels a GPU run needs). The real
runtime runs the whole pipeline in tests/orchestrator/test_container_pipeline.py.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch

from orchestrator.base.plan_types import Context
from orchestrator.checks import run_checks
from orchestrator.checks.container import charliecloud_problems
from orchestrator.launch.submit import container_wrapper
from orchestrator.planning.plan import PlanInputs, make_plan
from orchestrator.world import container as container_world
from orchestrator.world.runs import REPO_ROOT
from tests.orchestrator.conftest import compose_cfg
from tests.orchestrator.test_secrets import ENV_SECRETS
from trainer import kernel_build


def _image(tmp_path: Path, *folders: str) -> Path:
    root = tmp_path / "image"
    for folder in ("usr", "etc", *folders):
        (root / folder.lstrip("/")).mkdir(parents=True, exist_ok=True)
    for name in ("etc/hosts", "etc/resolv.conf"):
        (root / name).touch()
    return root


def _cfg(tmp_path: Path, image: Path, *extra: str, cluster: str = "devcluster"):
    return compose_cfg(["+experiment=codeparrot_smoke", f"cluster={cluster}", "container=charliecloud",
                        f"runs_root={tmp_path}/runs", f"cache_dir={tmp_path}/cache",
                        f"container.image={image}", *extra])


def _problems(cfg, tmp_path: Path) -> dict[str, list]:
    plan = make_plan(cfg, PlanInputs("r1", f"{tmp_path}/runs/x/r1"))
    out: dict[str, list] = {}
    for p in plan.problems + run_checks(Context(cfg), "inputs", at="launch"):
        out.setdefault(p.code, []).append(p)
    return out


def test_an_image_with_a_folder_for_every_bind_has_no_problems(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the launch directory, under /tmp: ch-run binds the host's /tmp
    assert _problems(_cfg(tmp_path, _image(tmp_path, str(REPO_ROOT))), tmp_path) == {}


# A checkout outside the host's /tmp, wherever this test's own clone lives (under /tmp, the repository
# would need no folder in the image: the next test).
CHECKOUT = Path("/srv/checkouts/slipway")


def test_a_bind_without_a_folder_in_the_image_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(container_world, "REPO_ROOT", CHECKOUT)
    image = _image(tmp_path)
    cfg = _cfg(tmp_path, image, "container.binds=[/srv/datasets]")
    found = {p.key: p for p in _problems(cfg, tmp_path)["container_mount_point"]}
    assert set(found) == {"(the repository)", "container.binds"}, found
    assert found["(the repository)"].value == str(CHECKOUT)
    assert f"mkdir -p {image}{CHECKOUT}" in found["(the repository)"].fix
    assert found["container.binds"].value == "/srv/datasets"


def test_folders_under_the_hosts_tmp_need_no_folder_in_the_image(tmp_path, monkeypatch):
    """ch-run binds the host's /tmp at /tmp (the wrapper unsets TMPDIR, which would replace it), so a
    checkout, runs_root or bind below it is there already (seen with the real ch-run: ``-b /tmp/x/sub``
    onto an image without that folder works, ``-b /work/x`` fails "can't mkdir"); a folder whose name only
    starts with /tmp is not below it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(container_world, "REPO_ROOT", Path("/tmp/clones/slipway"))
    cfg = _cfg(tmp_path, _image(tmp_path), "container.binds=[/tmp/datasets,/tmpdata]")
    found = {p.key: p.value for p in _problems(cfg, tmp_path)["container_mount_point"]}
    assert found == {"container.binds": "/tmpdata"}, found


def test_an_image_without_the_files_ch_run_binds_name_resolution_onto(tmp_path, monkeypatch):
    """ch-run replaces /etc/hosts and /etc/resolv.conf with the host's only where the image has them; a
    minimal root file system (debootstrap's) has no /etc/hosts, and the ranks then cannot resolve the
    first node's name (MASTER_ADDR): they wait for each other forever."""
    monkeypatch.chdir(tmp_path)
    image = _image(tmp_path, str(REPO_ROOT))
    (image / "etc" / "hosts").unlink()
    [p] = _problems(_cfg(tmp_path, image), tmp_path)["container_name_files"]
    assert p.key == "container.image" and f"touch {image}/etc/hosts" in p.fix


def test_an_image_that_is_not_a_root_file_system(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notanimage").mkdir()
    [p] = _problems(_cfg(tmp_path, tmp_path / "notanimage"), tmp_path)["container_image_format"]
    assert p.key == "container.image" and "ch-convert" in p.fix
    [p] = _problems(_cfg(tmp_path, tmp_path / "missing"), tmp_path)["file_missing"]
    assert p.key == "container.image"


def test_a_gpu_run_needs_the_images_kernels_built_from_this_checkout(tmp_path, monkeypatch):
    """On GPUs (cluster=slurm: 8 per node) the image's build must be in container.kernels_dir and come
    from this checkout's csrc/; on CPU clusters the trainer's eager fallback decides at run time."""
    monkeypatch.chdir(tmp_path)
    image = _image(tmp_path, str(REPO_ROOT), "/opt/slipway/trainer")
    gpu = ["cluster.partition=gpu"]
    [p] = _problems(_cfg(tmp_path, image, *gpu, cluster="slurm"), tmp_path)["container_kernels"]
    assert p.key == "container.kernels_dir" and "no compiled kernels" in p.message
    assert "kernels=eager" in p.fix
    library = image / "opt/slipway/trainer/_C.cpython-311-x86_64-linux-gnu.so"
    library.write_bytes(b"")
    kernel_build.write_stamp(library, torch.__version__, torch.version.cuda, tmp_path)  # no csrc/: no digest
    assert "container_kernels" not in _problems(_cfg(tmp_path, image, *gpu, cluster="slurm"), tmp_path)
    stamp = kernel_build.stamp_path(library)
    stamp.write_text(stamp.read_text().replace('"csrc": null', '"csrc": "0123456789abcdef"'))
    [p] = _problems(_cfg(tmp_path, image, *gpu, cluster="slurm"), tmp_path)["container_kernels"]
    assert "other csrc/ sources" in p.message
    assert "container_kernels" not in _problems(_cfg(tmp_path, image), tmp_path)  # CPU devcluster


def test_ch_run_must_be_on_the_path(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, _image(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    [p] = charliecloud_problems(Context(cfg))
    assert p.code == "charliecloud_missing" and "charliecloud-runtime" in p.fix


def test_the_wrapper_forwards_the_allowlist_per_task_and_keeps_secrets_off_argv(tmp_path, monkeypatch):
    """A stand-in ch-run prints its arguments and the --set-env stream: the image's environment first, then
    the allowlisted host variables (so theirs win), PYTHONPATH and the image's kernel folder; denylisted and
    other host variables are not there; secret values travel in the stream, never in argv or the file."""
    image = _image(tmp_path, str(REPO_ROOT))
    (image / "ch").mkdir()
    (image / "ch" / "environment").write_text("PATH=/opt/venv/bin:/usr/bin:/bin\nNCCL_DEBUG=WARN\n")
    fake = tmp_path / "ch-run"
    fake.write_text('#!/bin/bash\nfor a in "$@"; do echo "ARG $a"; case "$a" in --set-env=*) '
                    'sed "s/^/ENV /" "${a#--set-env=}" ;; esac; done\n')
    fake.chmod(0o755)
    monkeypatch.chdir(tmp_path)  # the launch directory: the image's working directory
    cfg = _cfg(tmp_path, image, f"container.charliecloud_bin={fake}")
    wrapper = tmp_path / "container_exec.sh"
    text = container_wrapper(cfg, make_plan(cfg, PlanInputs("r1", f"{tmp_path}/runs/x/r1")))
    wrapper.write_text(text)
    env = {"PATH": os.environ["PATH"], "SLURM_PROCID": "3", "NCCL_DEBUG": "INFO", "HF_TOKEN_PATH": "/h/.hf",
           "HOME_SECRET": "nope", "TMPDIR": "/scratch/job", **ENV_SECRETS}
    out = subprocess.run(["bash", str(wrapper), "python", "-c", "1"], env=env, capture_output=True,
                         text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    args = [line[4:] for line in lines if line.startswith("ARG ")]
    streamed = [line[4:] for line in lines if line.startswith("ENV ")]
    assert args[:2] == ["--unset-env=*", "--env-no-expand"], args
    assert args[-5:] == [str(image), "--", "python", "-c", "1"], args
    assert streamed[0] == "PATH=/opt/venv/bin:/usr/bin:/bin" and "SLURM_PROCID=3" in streamed
    assert streamed.index("NCCL_DEBUG=INFO") > streamed.index("NCCL_DEBUG=WARN")  # the host's value wins
    assert streamed[-2:] == [f"PYTHONPATH={REPO_ROOT}", "SLIPWAY_KERNELS_DIR=/opt/slipway/trainer"]
    assert not any(s.startswith(("HF_TOKEN_PATH=", "HOME_SECRET=", "TMPDIR=")) for s in streamed)
    assert f"WANDB_API_KEY={ENV_SECRETS['WANDB_API_KEY']}" in streamed
    assert f"-b {REPO_ROOT}" in " ".join(args) and args[args.index("-c") + 1] == str(tmp_path)
    for value in ENV_SECRETS.values():
        assert value not in text and all(value not in a for a in args)
