"""The container the jobs run in: an image is set and is something the runtime starts (a SIF or squashfs
file for Apptainer, a squashfs file or a registry reference for pyxis, no credentials in it, neither cut
short; a root file system folder for Charliecloud, with a folder for each bind), the folders it binds can
be bound, pyxis is not asked of the local executor, the srun on this node has pyxis's options and ch-run
is there, and a GPU run's image has the compiled kernels of the checkout it runs. What the binds and image
references are: orchestrator/world/container.py."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

from orchestrator.base.plan_types import Context
from orchestrator.base.problems import Problem
from orchestrator.base.schema import SlipwayConfig
from orchestrator.checks.data import missing_files
from orchestrator.world.container import (
    CH_NAME_FILES,
    CREDENTIALS,
    MOUNT_UNSAFE,
    PYXIS_OPTIONS,
    REGISTRY_REF,
    SYSTEM_DIRS,
    image_file_format,
    image_is_file,
    missing_mount_points,
    mount_points,
)
from trainer import kernel_build
from trainer.config import COMPILED_KERNEL_SETS
from trainer.run_files import RUN_JSON

_BUILD = {"apptainer": "containers/build.sh and set container.image=/path/slipway-ngc.sif",
          "pyxis": "containers/build_sqsh.sh and set container.image=/path/slipway-ngc.sqsh",
          "charliecloud": "ch-convert /path/slipway-ngc.sqsh /path/slipway-ngc (or containers/dev_image.py "
                          "for a CPU image) and set container.image=/path/slipway-ngc"}



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
    """An image file (Charliecloud: folder) must exist now (a pyxis registry reference is pulled by the
    job)."""
    c = ctx.cfg.container
    local = c.kind in ("apptainer", "charliecloud") or (c.kind == "pyxis" and image_is_file(c.image or ""))
    if c.image and local:
        return missing_files(ctx, [("container.image", c.image)])
    return []


def charliecloud_image_problems(ctx: Context) -> list[Problem]:
    """A Charliecloud image is a root file system folder with a folder for every bind (ch-run binds onto
    folders the image has and cannot make them in a read-only image), and on GPUs its kernel build is
    there and made from this checkout's csrc/."""
    cfg = ctx.cfg
    c = cfg.container
    if c.kind != "charliecloud" or not c.image or not os.path.isdir(c.image):
        return []  # a missing image is file_missing's
    image = os.path.abspath(c.image)
    if not os.path.isdir(os.path.join(image, "usr")):
        return [Problem("container_image_format", "container.image", c.image,
                        "is not a root file system folder (no usr/), which is what ch-run starts",
                        f"make one with {_BUILD['charliecloud']}")]
    out = [Problem("container_name_files", "container.image", c.image, f"the image has no /{name}, onto "
                   "which ch-run binds the host's: node names (torch.distributed's MASTER_ADDR) would not "
                   "resolve", f"make it once: touch {os.path.join(image, name)}")
           for name in CH_NAME_FILES if not os.path.isfile(os.path.join(image, name))]
    out += [Problem("container_mount_point", key, path, f"the image {image} has no folder {path} to bind it "
                    "onto (ch-run binds onto folders the image has; it cannot make one in a read-only image)",
                    f"make it once: mkdir -p {os.path.join(image, path.lstrip('/'))} (or bind a parent "
                    "folder the image has, through container.binds)")
            for key, path in missing_mount_points(image, mount_points(cfg))]
    if cfg.cluster.gpus_per_node and cfg.kernels in COMPILED_KERNEL_SETS and c.kernels_dir:
        out += _image_kernel_problems(image, c.kernels_dir, cfg.kernels)
    return out


def _image_kernel_problems(image: str, kernels_dir: str, kernels: str) -> list[Problem]:
    """A GPU run expects the image's kernel build in container.kernels_dir, from this checkout's csrc/."""
    folder = os.path.join(image, kernels_dir.lstrip("/"))
    builds = sorted(glob.glob(os.path.join(folder, "_C*.so")))
    fix = (f"rebuild the image from this checkout (containers/README.md), point container.kernels_dir at "
           f"its build, or set kernels=eager (kernels={kernels} expects the compiled kernels on GPUs)")
    if not builds:
        return [Problem("container_kernels", "container.kernels_dir", kernels_dir,
                        f"the image {image} has no compiled kernels (trainer/_C*.so) there", fix)]
    stamp = kernel_build.read_stamp(builds[0])
    here = kernel_build.sources_digest(kernel_build.checkout_root())
    if stamp and here and stamp.get("csrc") and stamp["csrc"] != here:
        return [Problem("container_kernels", "container.kernels_dir", kernels_dir,
                        f"the image's kernels were built from other csrc/ sources (digest {stamp['csrc']}) "
                        f"than this checkout's ({here})", fix)]
    return []


def charliecloud_problems(ctx: Context) -> list[Problem]:
    """container=charliecloud: ch-run is on this node's PATH (the jobs start it in every task)."""
    c = ctx.cfg.container
    if c.kind != "charliecloud" or shutil.which(c.charliecloud_bin):
        return []
    return [Problem("charliecloud_missing", "container.charliecloud_bin", c.charliecloud_bin,
                    "is not on this node's PATH",
                    "install Charliecloud (Debian/Ubuntu: charliecloud-runtime; or `module load "
                    "charliecloud`), or set container.charliecloud_bin to ch-run's path")]


def image_problems(ctx: Context) -> list[Problem]:
    """An image file is what its runtime starts, by its header (world/container.py image_file_format):
    pyxis a squashfs file (an Apptainer .sif is not; enroot cannot start it), Apptainer a SIF file or a
    bare squashfs image; neither cut short (an interrupted copy)."""
    c = ctx.cfg.container
    wanted = {"pyxis": ("squashfs",), "apptainer": ("sif", "squashfs")}.get(c.kind)
    if not wanted or not c.image or not os.path.isfile(c.image) or (c.kind == "pyxis"
                                                                     and not image_is_file(c.image)):
        return []  # a reference (container_problems), a sandbox folder, or a missing file (file_missing)
    kind, wrong = image_file_format(c.image)
    if kind in wanted and not wrong:
        return []
    if c.kind == "pyxis":
        what = "is not a squashfs file, which is what pyxis starts (an Apptainer .sif is not one)"
        fix = "build one with containers/build_sqsh.sh, or use a .sif with container=apptainer_ngc"
    else:
        what = ("is neither a SIF image (no SIF_MAGIC at byte 32) nor a squashfs one, which is what "
                "apptainer exec starts")
        fix = f"build one with {_BUILD['apptainer']}"
    if kind in wanted:  # the right format, damaged
        what, fix = wrong, "copy the image again (or rebuild it) and check its size against the original"
    return [Problem("container_image_format", "container.image", c.image, what, fix)]


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
