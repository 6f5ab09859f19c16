"""The container half of the job scripts: the per-task wrapper of Apptainer and Charliecloud (a clean
environment, the allowlisted variables and every variable ``cluster.env`` names forwarded per task, the
binds; Apptainer's ``--nv`` only in jobs that hold GPUs) and pyxis's srun flags and preamble (mounts,
``--container-env`` names). Each runtime binds the folders of :mod:`~orchestrator.world.container`,
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


def _env_loop(container: ContainerConfig, allowed: str, names: tuple[str, ...],
              indent: str = "") -> list[str]:
    """A loop over the exported variables that runs ``allowed`` for each one ``names`` lists (cluster.env's:
    the site asked for them by name, so the denylist does not apply) and each allowlisted, not denylisted
    one."""
    allow, deny = _env_patterns(container)
    named = [f"    {'|'.join(names)}) {allowed} ;;"] if names else []
    lines = ["for name in $(compgen -e); do", '  case "$name" in', *named, f"    {deny}) continue ;;",
             f"    {allow}) {allowed} ;;", "  esac", "done"]
    return [indent + line for line in lines]


def job_variables(container: ContainerConfig, code_dir: str) -> list[tuple[str, str]]:
    """What every runtime sets inside the image beyond the allowlist: the launched repository on PYTHONPATH
    and, when the image has its own kernel build, where it is."""
    out = [("PYTHONPATH", code_dir)]
    if container.kernels_dir:
        out.append((KERNELS_DIR_ENV, container.kernels_dir))
    return out


def render_container_wrapper(container: ContainerConfig, binds: list[str], code_dir: str, workdir: str = "",
                             names: tuple[str, ...] = ()) -> str:
    """``bash wrapper [--nv] python ...`` runs python in the image, with only the variables ``names`` lists
    (cluster.env's) and the allowlisted ones inside (Apptainer, or Charliecloud, whose working directory
    ``workdir`` is bound too). ``--nv`` (GPU jobs: :func:`python_command`) is Apptainer's."""
    if container.kind == "charliecloud":
        return _charliecloud_wrapper(container, _bind_list(container, binds, code_dir, workdir), code_dir,
                                     workdir, names)
    bind = ",".join(_bind_list(container, binds, code_dir))
    return "\n".join(
        [
            "#!/bin/bash",
            '# Runs "$@" inside the Slipway image: --cleanenv drops the host environment; the variables',
            "# cluster.env names and the allowlist below are forwarded per task (APPTAINERENV_*), so",
            "# per-rank SLURM_PROCID/LOCALID arrive intact. Secret values (WANDB_API_KEY, HF_TOKEN) pass",
            "# through the environment only, never this file. GPU jobs call it with --nv first.",
            "set -eu",
            'nv=""',
            'if [ "${1:-}" = --nv ]; then nv=--nv; shift; fi',
            *_env_loop(container, 'export "APPTAINERENV_${name}=${!name}"', names),
            *(f"export APPTAINERENV_{k}={shlex.quote(v)}" for k, v in job_variables(container, code_dir)),
            f"exec {shlex.quote(container.apptainer_bin)} exec $nv --cleanenv --bind {shlex.quote(bind)} "
            f'{shlex.quote(str(container.image))} "$@"',
            "",
        ]
    )


def _charliecloud_wrapper(container: ContainerConfig, binds: list[str], code_dir: str, workdir: str,
                          names: tuple[str, ...]) -> str:
    image = shlex.quote(str(container.image))
    flags = " ".join(f"-b {shlex.quote(b)}" for b in binds)
    return "\n".join(
        [
            "#!/bin/bash",
            '# Runs "$@" inside the Slipway image with Charliecloud: --unset-env=\'*\' drops the host',
            "# environment, then --set-env reads, in order, the image's own (/ch/environment), the variables",
            "# cluster.env names and the allowlisted ones below, per task (per-rank SLURM_PROCID/LOCALID",
            "# arrive intact; the host's values win). They pass through a pipe: secret values",
            "# (WANDB_API_KEY, HF_TOKEN) are never in this file or on a command line.",
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
            *_env_loop(container, 'slipway_put "$name"', names, indent="  "),
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
    names: tuple[str, ...] = ()  # what cluster.env names: to --container-env too, never unset


def pyxis_preamble(p: PyxisSpec) -> list[str]:
    """Shell lines before the srun: PYTHONPATH, the denylist unset, and the --container-env names.

    pyxis has no --cleanenv: every exported host variable reaches the task, but one the image also sets
    keeps the image's value unless its name is given to --container-env (NVIDIA/pyxis, ``srun --help``).
    The allowlist and the names cluster.env sets are the variables whose host values must win (NCCL_*,
    OMP_NUM_THREADS, ...); they are expanded when srun starts, so per-attempt values (MASTER_PORT,
    SLIPWAY_ATTEMPT) are included."""
    _, deny = _env_patterns(p.container)
    keep = f"{'|'.join(p.names)}) ;; " if p.names else ""
    return [
        "# pyxis: each srun runs its tasks in the image. The host environment reaches them, but a variable",
        "# the image also sets keeps the image's value unless named in --container-env, which gets the",
        "# names cluster.env sets and the allowlisted ones from slipway_container_env (names only: values",
        "# stay in the environment, so no secret is written here). Denylisted variables name host files",
        "# that are not mounted: unset.",
        *(f"export {k}={shlex.quote(v)}" for k, v in job_variables(p.container, p.code_dir)),
        f'for name in $(compgen -e); do case "$name" in {keep}{deny}) unset "$name" ;; esac; done',
        "slipway_container_env() {",
        f"  local name names={','.join(k for k, _ in job_variables(p.container, p.code_dir))}",
        *_env_loop(p.container, 'names="$names,$name"', p.names, indent="  "),
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


def python_command(container: ContainerConfig, wrapper_path: str, python: str, gpus: bool = False) -> str:
    """The interpreter string submitit puts before ``-u -m submitit.core._submit FOLDER``; ``gpus``: the job
    holds GPUs, which Apptainer makes visible in the image with --nv (on a CPU node --nv only warns that
    there is no driver, and would bind a GPU node's driver into a job that was given no GPU)."""
    if container.kind in WRAPPER_KINDS:
        nv = " --nv" if gpus and container.kind == "apptainer" else ""
        return f"bash {shlex.quote(wrapper_path)}{nv} python"
    if container.kind == "pyxis":
        return "python"  # the image's; srun's container flags put the task inside it
    return shlex.quote(python)
