"""The container the jobs run in: an image is set and is something the runtime starts (a squashfs file or
a registry reference for pyxis, no credentials in it), the folders it binds can be bound, pyxis is not
asked of the local executor, and the srun on this node has pyxis's options. What the binds and image
references are: orchestrator/container.py."""

from __future__ import annotations

import os
import subprocess
from typing import TYPE_CHECKING

from orchestrator.checks.data import missing_files
from orchestrator.container import (
    CREDENTIALS,
    MOUNT_UNSAFE,
    PYXIS_OPTIONS,
    REGISTRY_REF,
    SQUASHFS_MAGIC,
    SYSTEM_DIRS,
    image_is_file,
    mount_points,
)
from orchestrator.problems import Problem
from orchestrator.schema import SlipwayConfig
from trainer.run_files import RUN_JSON

if TYPE_CHECKING:
    from orchestrator.checks import Context

_BUILD = {"apptainer": "containers/build.sh and set container.image=/path/slipway-ngc.sif",
          "pyxis": "containers/build_sqsh.sh and set container.image=/path/slipway-ngc.sqsh"}


def container_problems(ctx: Context) -> list[Problem]:
    """The image and the folders the runtime binds."""
    cfg = ctx.cfg
    c, out = cfg.container, []
    if c.kind not in _BUILD:
        return out
    if not c.image:
        out.append(Problem("container_image", "container.image", None, f"{c.kind} needs an image",
                           f"build one with {_BUILD[c.kind]}"))
    if c.kind == "pyxis":
        out += _pyxis_config(cfg)
    unsafe, chars = MOUNT_UNSAFE[c.kind]
    for key, path in mount_points(cfg):
        if unsafe.search(path):
            out.append(Problem("container_mount", key, path, f"{c.kind} binds it into the image, and its "
                               f"list of binds cannot hold a path with {chars}",
                               f"use a path without {chars} (a symlink to it will do)"))
        elif path in SYSTEM_DIRS:
            out.append(Problem("container_mount", key, path, f"{c.kind} would bind it over the image's own "
                               f"{path} (its CUDA, Python and libraries)",
                               "use a folder of its own, e.g. /shared/<project>/slipway"))
    return out


def _pyxis_config(cfg: SlipwayConfig) -> list[Problem]:
    image, out = cfg.container.image, []
    if cfg.cluster.executor == "local":
        out.append(Problem("container_local", "container.kind", "pyxis",
                           "pyxis runs containers through srun (--container-image); the local executor "
                           "starts this machine's processes without srun",
                           "use container=none (or container=apptainer_ngc) with cluster=local, or a Slurm "
                           "cluster whose srun has pyxis"))
    if not image or image_is_file(image):
        return out  # a file: file_missing and container_image_format check it
    if CREDENTIALS.match(image):
        out.append(Problem("container_image_credentials", "container.image", "<redacted>",
                           f"holds USER:PASSWORD@ (job scripts and {RUN_JSON} are written to disk)",
                           "keep only USER@ and put the password in enroot's credentials file "
                           "($ENROOT_CONFIG_PATH/.credentials, see enroot's import docs)"))
    elif not REGISTRY_REF.fullmatch(image):
        out.append(Problem("container_image_uri", "container.image", image,
                           "is neither a squashfs file (a path starting with / or ., or ending .sqsh) nor a "
                           "registry reference pyxis reads ([USER@][REGISTRY#]IMAGE[:TAG], lower-case image "
                           "name, optionally docker:// and @sha256:DIGEST)",
                           "write e.g. registry.example.org#team/slipway:1.0 or "
                           "/shared/images/slipway-ngc.sqsh"))
    return out


def image_file_problems(ctx: Context) -> list[Problem]:
    """An image file must exist now (a pyxis registry reference is pulled by the job)."""
    c = ctx.cfg.container
    if c.image and (c.kind == "apptainer" or (c.kind == "pyxis" and image_is_file(c.image))):
        return missing_files(ctx, [("container.image", c.image)])
    return []


def image_problems(ctx: Context) -> list[Problem]:
    """With pyxis, an image file must be squashfs (an Apptainer .sif is not; enroot cannot start it)."""
    c = ctx.cfg.container
    if c.kind != "pyxis" or not c.image or not image_is_file(c.image) or not os.path.isfile(c.image):
        return []  # a reference (container_problems) or a missing file (file_missing)
    with open(c.image, "rb") as f:
        magic = f.read(len(SQUASHFS_MAGIC))
    if magic == SQUASHFS_MAGIC:
        return []
    return [Problem("container_image_format", "container.image", c.image,
                    "is not a squashfs file, which is what pyxis starts (an Apptainer .sif is not one)",
                    "build one with containers/build_sqsh.sh, or use a .sif with container=apptainer_ngc")]


def pyxis_problems(ctx: Context, timeout_s: float = 30.0) -> list[Problem]:
    """container=pyxis on Slurm: the srun on this node's PATH lists pyxis's options (``srun --help``).
    pyxis is a SPANK plugin, and a loaded plugin's options are listed there; without them the jobs would
    fail on their first srun, after their queue wait."""
    cfg = ctx.cfg
    if cfg.container.kind != "pyxis" or cfg.cluster.executor != "slurm":
        return []  # the local executor is refused by container_problems (container_local)
    fix = ("use container=apptainer_ngc or container=none; if the site has pyxis, run the launch where its "
           "srun loads it (plugstack.conf), e.g. on the cluster's login node")
    try:
        out = subprocess.run(["srun", "--help"], capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        return [Problem("pyxis_missing", "container.kind", "pyxis", "srun is not on this node's PATH", fix)]
    except subprocess.TimeoutExpired:
        return [Problem("pyxis_missing", "container.kind", "pyxis",
                        f"srun --help did not answer within {timeout_s:.0f} s", fix)]
    listed = out.stdout + out.stderr
    missing = [o for o in PYXIS_OPTIONS if o not in listed]
    if not missing:
        return []
    if len(missing) == len(PYXIS_OPTIONS):
        return [Problem("pyxis_missing", "container.kind", "pyxis",
                        "srun --help lists no --container-* option: pyxis is not loaded here", fix)]
    return [Problem("pyxis_missing", "container.kind", "pyxis",
                    f"srun --help does not list {', '.join(missing)}: this pyxis is older than the jobs need "
                    "(--container-env came with pyxis 0.15)", "ask the site to update pyxis, or " + fix)]
