"""The container half of the job scripts: the per-task wrapper of Apptainer and Charliecloud (a clean
environment, the allowlisted variables forwarded per task, the binds) and pyxis's srun flags and preamble
(mounts, ``--container-env`` names). Each runtime binds the folders of :mod:`~orchestrator.world.container`,
the launched repository first on PYTHONPATH and names the image's own kernel build (``container.kernels_dir``,
trainer/kernel_build.py), which the job loads instead of the repository's; :mod:`orchestrator.render` puts
these pieces into the sbatch script."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from orchestrator.base.schema import ContainerConfig
from orchestrator.world.container import WRAPPER_KINDS
from trainer.kernel_build import KERNELS_DIR_ENV


def container_binds(paths: list[str]) -> list[str]:
    """Unique absolute bind paths in first-seen order, without those inside another (a bind of a parent,
    wherever it is in the list, makes its children redundant)."""
    def inside(p: str, q: str) -> bool:
        return p.startswith(q.rstrip("/") + "/")

    unique = list(dict.fromkeys(p for p in paths if p))
    return [p for p in unique if not any(inside(p, q) for q in unique)]


def _bind_list(container: ContainerConfig, binds: list[str] | tuple[str, ...], code_dir: str,
               *extra: str) -> list[str]:
    """What both runtimes bind: the repository first (never hidden), the job's folders, container.binds."""
    return container_binds([code_dir, *binds, *container.binds, *extra])


def _env_patterns(container: ContainerConfig) -> tuple[str, str]:
    """container.env_allowlist / env_denylist as shell ``case`` patterns (allow, deny)."""
    allow, deny = container.env_allowlist, container.env_denylist
    return "|".join(allow) or "SLURM_*", "|".join(deny) or "_SLIPWAY_NONE_"


def _env_loop(container: ContainerConfig, allowed: str, indent: str = "") -> list[str]:
    """A loop over the exported variables that runs ``allowed`` for each allowlisted, not denylisted name."""
    allow, deny = _env_patterns(container)
    lines = ["for name in $(compgen -e); do", '  case "$name" in', f"    {deny}) continue ;;",
             f"    {allow}) {allowed} ;;", "  esac", "done"]
    return [indent + line for line in lines]


def job_variables(container: ContainerConfig, code_dir: str) -> list[tuple[str, str]]:
    """What every runtime sets inside the image beyond the allowlist: the launched repository on PYTHONPATH
    and, when the image has its own kernel build, where it is."""
    out = [("PYTHONPATH", code_dir)]
    if container.kernels_dir:
        out.append((KERNELS_DIR_ENV, container.kernels_dir))
    return out


def render_container_wrapper(container: ContainerConfig, binds: list[str], code_dir: str, gpus: bool,
                             workdir: str = "") -> str:
    """``bash wrapper python ...`` runs python in the image, with only allowlisted variables inside
    (Apptainer, or Charliecloud, whose working directory ``workdir`` is bound too)."""
    if container.kind == "charliecloud":
        return _charliecloud_wrapper(container, _bind_list(container, binds, code_dir, workdir), code_dir,
                                     workdir)
    nv = "--nv " if gpus else ""
    bind = ",".join(_bind_list(container, binds, code_dir))
    return "\n".join(
        [
            "#!/bin/bash",
            '# Runs "$@" inside the Slipway image: --cleanenv drops the host environment; the allowlist',
            "# below is forwarded per task (APPTAINERENV_*), so per-rank SLURM_PROCID/LOCALID arrive intact.",
            "# Secret values (WANDB_API_KEY, HF_TOKEN) pass through the environment only, never this file.",
            "set -eu",
            *_env_loop(container, 'export "APPTAINERENV_${name}=${!name}"'),
            *(f"export APPTAINERENV_{k}={shlex.quote(v)}" for k, v in job_variables(container, code_dir)),
            f"exec {shlex.quote(container.apptainer_bin)} exec {nv}--cleanenv --bind {shlex.quote(bind)} "
            f'{shlex.quote(str(container.image))} "$@"',
            "",
        ]
    )


def _charliecloud_wrapper(container: ContainerConfig, binds: list[str], code_dir: str, workdir: str) -> str:
    image = shlex.quote(str(container.image))
    flags = " ".join(f"-b {shlex.quote(b)}" for b in binds)
    return "\n".join(
        [
            "#!/bin/bash",
            '# Runs "$@" inside the Slipway image with Charliecloud: --unset-env=\'*\' drops the host',
            "# environment, then --set-env reads, in order, the image's own (/ch/environment) and the",
            "# allowlisted variables below, per task (per-rank SLURM_PROCID/LOCALID arrive intact; the",
            "# host's values win). They pass through a pipe: secret values (WANDB_API_KEY, HF_TOKEN) are",
            "# never in this file or on a command line.",
            "set -eu",
            'export USER="${USER:-$(id -un)}"  # ch-run needs it',
            "# ch-run binds $TMPDIR, if set, at /tmp in place of the host's /tmp, below which the job's",
            "# folders need no mount point in the image.",
            "unset TMPDIR",
            f"image={image}",
            "slipway_put() {",
            '  local value="${!1}"',
            "  if [[ \"$value\" == *$'\\n'* ]]; then echo \"container_exec.sh: $1 has a newline\" >&2",
            "  else printf '%s=%s\\n' \"$1\" \"$value\"; fi",
            "}",
            "slipway_env() {",
            '  if [ -r "$image/ch/environment" ]; then cat "$image/ch/environment"',
            '  else echo "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"; fi',
            *_env_loop(container, 'slipway_put "$name"', indent="  "),
            *(f"  echo {shlex.quote(f'{k}={v}')}" for k, v in job_variables(container, code_dir)),
            "}",
            f"exec {shlex.quote(container.charliecloud_bin)} --unset-env='*' --env-no-expand "
            f'--set-env=<(slipway_env) {flags} -c {shlex.quote(workdir)} "$image" -- "$@"',
            "",
        ]
    )


@dataclass(frozen=True)
class PyxisSpec:
    """What the srun lines of a job need to run each task in a pyxis/enroot container."""

    container: ContainerConfig  # image (absolute when a file: container.job_image), binds, env lists
    binds: tuple[str, ...]  # the job's folders (world/container.host_paths), mounted at their paths
    code_dir: str  # mounted first and put on PYTHONPATH: jobs run the code that was launched
    workdir: str  # the launch directory, mounted: relative paths in the job specs resolve against it


def pyxis_preamble(p: PyxisSpec) -> list[str]:
    """Shell lines before the srun: PYTHONPATH, the denylist unset, and the --container-env names.

    pyxis has no --cleanenv: every exported host variable reaches the task, but one the image also sets
    keeps the image's value unless its name is given to --container-env (NVIDIA/pyxis, ``srun --help``).
    The allowlist therefore names the variables whose host values must win (NCCL_*, TORCH_*, ...); it is
    expanded when srun starts, so per-attempt values (MASTER_PORT, SLIPWAY_ATTEMPT) are included."""
    _, deny = _env_patterns(p.container)
    return [
        "# pyxis: each srun runs its tasks in the image. The host environment reaches them, but a variable",
        "# the image also sets keeps the image's value unless named in --container-env, which gets the",
        "# allowlisted names from slipway_container_env (names only: values stay in the environment, so no",
        "# secret is written here). Denylisted variables name host files that are not mounted: unset.",
        *(f"export {k}={shlex.quote(v)}" for k, v in job_variables(p.container, p.code_dir)),
        f'for name in $(compgen -e); do case "$name" in {deny}) unset "$name" ;; esac; done',
        "slipway_container_env() {",
        f"  local name names={','.join(k for k, _ in job_variables(p.container, p.code_dir))}",
        *_env_loop(p.container, 'names="$names,$name"', indent="  "),
        '  echo "$names"',
        "}",
    ]


def pyxis_srun_flags(p: PyxisSpec) -> str:
    """The pyxis options of every srun line (srun --help lists them when the plugin is loaded)."""
    mounts = ",".join(_bind_list(p.container, p.binds, p.code_dir, p.workdir))
    words = [
        f"--container-image={p.container.image}",
        f"--container-mounts={mounts}",  # SRC alone: mounted at the same path
        f"--container-workdir={p.workdir}",
        # A mounted $HOME puts ~/.local's pip --user packages ahead of the image's.
        "--no-container-mount-home",
    ]
    return " ".join(shlex.quote(w) for w in words) + ' --container-env="$(slipway_container_env)"'


def python_command(container: ContainerConfig, wrapper_path: str, python: str) -> str:
    """The interpreter string submitit puts before ``-u -m submitit.core._submit FOLDER``."""
    if container.kind in WRAPPER_KINDS:
        return f"bash {shlex.quote(wrapper_path)} python"
    if container.kind == "pyxis":
        return "python"  # the image's; srun's container flags put the task inside it
    return shlex.quote(python)
