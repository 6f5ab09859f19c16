"""What a containerised job needs from the host, for both runtimes (pure): the folders it reads or writes,
each with the config key it comes from, and what kind of reference ``container.image`` is.

Apptainer and Charliecloud bind these folders (container_render.render_container_wrapper) and pyxis
mounts them (container_render.pyxis_srun_flags); checks/container.py checks them. One list, so a folder
added here reaches every runtime and the plan's checks.

pyxis reads ``--container-image`` as a squashfs file when it starts with ``/`` or ``.`` and as an enroot
registry reference otherwise (NVIDIA/pyxis ``pyxis_slurmstepd.c``); the documented form is
``[USER@][REGISTRY#]IMAGE[:TAG]`` (pyxis README, ``srun --help``), which enroot also takes with a
``docker://`` or ``dockerd://`` prefix and an ``@sha256:`` digest (enroot ``src/docker.sh``).
"""

from __future__ import annotations

import os
import re
import struct

from orchestrator.base.schema import ContainerConfig, SlipwayConfig
from orchestrator.world.runs import REPO_ROOT

# The first bytes of a squashfs file (little-endian "sqsh"); an Apptainer .sif starts otherwise. The
# superblock (Linux include/uapi squashfs_fs.h, struct squashfs_super_block) holds the format's major
# version at byte 28 (u16; 4 since 2009, what mksquashfs writes and enroot and Apptainer mount) and the
# image's length at byte 40 (u64 bytes_used; mksquashfs pads the file beyond it to 4 KiB).
SQUASHFS_MAGIC = b"hsqs"
SQUASHFS_SUPER = struct.Struct("<4s24xH10xQ")  # magic, s_major (byte 28), bytes_used (byte 40)
# A SIF file's global header (apptainer/sif, pkg/sif/sif.go and load.go, little-endian): a 32-byte launch
# line ("#!/usr/bin/env run-singularity\n" from apptainer build; zeros from siftool new), "SIF_MAGIC\0" at
# byte 32, the version, the architecture, the image's UUID, then eight int64s, of which the last two are
# where the data objects start and how many bytes they take (the file's end, unless it was cut short).
SIF_HEADER = struct.Struct("<32s10s3s3s16s8q")
SIF_MAGIC = b"SIF_MAGIC\0"
# A name ending like this is a file even when written without "/" or "./" (made absolute for the job),
# so ``container.image=slipway.sqsh`` is not sent to Docker Hub as an image named slipway.sqsh.
IMAGE_FILE_SUFFIXES = (".sqsh", ".squashfs", ".sif")

REGISTRY_REF = re.compile(
    r"(?:dockerd?://)?"  # enroot's schemes; pyxis adds docker:// when there is none
    r"(?:[^@#/:\s]+@)?"  # USER@ (the password lives in enroot's credentials file, never here)
    r"(?:[A-Za-z0-9.-]+(?::[0-9]+)?#)?"  # REGISTRY# (host[:port])
    r"[a-z0-9][a-z0-9._/-]*"  # IMAGE: lower-case path components (Docker's rule)
    r"(?::[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?"  # :TAG
    r"(?:@sha256:[0-9a-f]{64})?"  # @DIGEST
)
# USER:PASSWORD@ before the registry; "@sha256:" is a digest, not credentials.
CREDENTIALS = re.compile(r"^(?:dockerd?://)?[^@#/\s]*:[^@#/\s]*@(?!sha256:)")

# Host folders that must not be mounted over the image's own (CUDA, Python, NCCL live under /usr and /opt).
SYSTEM_DIRS = frozenset(
    {"/", "/bin", "/dev", "/etc", "/lib", "/lib64", "/opt", "/proc", "/run", "/sbin", "/sys", "/usr",
     "/usr/lib", "/usr/local", "/var"}
)
# What a path in the runtime's bind list cannot hold (pattern, in words). Both split the list on "," and
# each entry on ":" (apptainer --bind SRC[:DST[:OPTS]],...; pyxis --container-mounts=SRC[:DST[:FLAGS]],...);
# pyxis before 0.24 also splits on white space (its mount table was not escaped: NVIDIA/pyxis aff5834).
MOUNT_UNSAFE = {
    "apptainer": (re.compile(r"[,:]"), "',' or ':'"),
    "pyxis": (re.compile(r"[,:\s]"), "',', ':' or white space"),
    "charliecloud": (re.compile(r":"), "':'"),  # one ch-run -b SRC[:DST] per folder
}
# The runtimes a per-run wrapper script starts in each task (container_exec.sh); pyxis is srun's.
WRAPPER_KINDS = ("apptainer", "charliecloud")
# The files ch-run replaces with the host's, but only where the image has them: without them the node names
# the jobs use (MASTER_ADDR) do not resolve in the image.
CH_NAME_FILES = ("etc/hosts", "etc/resolv.conf")
# Where ch-run binds the host's /tmp (its default; the wrapper unsets TMPDIR, which would move it): folders
# below it need no mount point in the image.
CH_HOST_TMP = "/tmp"
# The srun options the rendered pyxis jobs use (container_render.pyxis_srun_flags), each listed by
# `srun --help` once the plugin is loaded; --container-env needs pyxis 0.15 or later.
PYXIS_OPTIONS = ("--container-image", "--container-mounts", "--container-workdir",
                 "--no-container-mount-home", "--container-env")


def image_file_format(path: str) -> tuple[str, str]:
    """What an image file is by its header, ``("sif" | "squashfs" | "", what is wrong with it)``: "" and
    "" for neither (a text file, an ext3 image, ...); a header cut short or a file shorter than its header
    says is wrong (an interrupted copy)."""
    with open(path, "rb") as f:
        head, size = f.read(SIF_HEADER.size), os.fstat(f.fileno()).st_size
    if head.startswith(SQUASHFS_MAGIC):
        if len(head) < SQUASHFS_SUPER.size:
            return "squashfs", f"its squashfs superblock is cut short ({size} bytes)"
        _, major, used = SQUASHFS_SUPER.unpack_from(head)
        if major != 4:
            return "squashfs", f"it is squashfs version {major}, not 4 (which mksquashfs writes)"
        if used > size:
            return "squashfs", f"it is cut short: its superblock says {used} bytes, the file has {size}"
        return "squashfs", ""
    if len(head) == SIF_HEADER.size and head[32:42] == SIF_MAGIC:
        data_offset, data_length = SIF_HEADER.unpack(head)[-2:]
        if data_offset + data_length > size:
            return "sif", (f"it is cut short: its SIF header says {data_offset + data_length} bytes, the "
                           f"file has {size}")
        return "sif", ""
    return "", ""


def image_is_file(image: str) -> bool:
    return image.startswith(("/", ".")) or image.endswith(IMAGE_FILE_SUFFIXES)


def job_image(container: ContainerConfig) -> str | None:
    """The image as a job names it: files absolute (jobs may start elsewhere), references unchanged."""
    image = container.image
    if not image:
        return None
    if container.kind in WRAPPER_KINDS or image_is_file(image):
        return os.path.abspath(image)
    return image


def host_paths(cfg: SlipwayConfig) -> list[tuple[str, str]]:
    """(config key, absolute folder) for every configured folder a job reads or writes. The repository
    and ``container.binds`` are added by the renderers (the repository first, so it is never hidden)."""
    tok, ck = cfg.tokenizer, cfg.checkpoint
    out = [("runs_root", cfg.runs_root), ("cache_dir", cfg.cache_dir)]  # a null cache_dir is in runs_root
    out += [("data.paths", os.path.dirname(os.path.abspath(p))) for p in cfg.data.inputs()]
    files = (("tokenizer.vocab_file", tok.vocab_file), ("tokenizer.merge_file", tok.merge_file))
    out += [(key, os.path.dirname(os.path.abspath(p))) for key, p in files if p]
    out += [("data.corpus.roots", p) for p in (cfg.data.corpus.roots if cfg.data.corpus else [])]
    out += [("tokenizer.model", tok.model), ("data.cache_dir", cfg.data.cache_dir), ("run_dir", cfg.run_dir),
            ("checkpoint.dir", ck.dir), ("checkpoint.load_dir", ck.load_dir)]
    return [(key, os.path.abspath(p)) for key, p in out if p]


def mount_points(cfg: SlipwayConfig) -> list[tuple[str, str]]:
    """Everything the runtime binds, keyed for the plan's problems, in the renderers' order: the
    repository, the job's folders, container.binds and (pyxis, charliecloud: the container's working
    directory) the launch directory."""
    out = [("(the repository)", str(REPO_ROOT)), *host_paths(cfg)]
    out += [("container.binds", os.path.abspath(b)) for b in cfg.container.binds]
    if cfg.container.kind in ("pyxis", "charliecloud"):
        out.append(("(the launch directory)", os.getcwd()))
    return out


def missing_mount_points(image: str, paths: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """charliecloud: the (key, folder) pairs ch-run could not bind because the image (a directory) has no
    folder at that path to bind onto (ch-run does not create them in a read-only image). Folders under
    the host /tmp it binds anyway are fine, and so is a folder inside another bound one."""
    bound = [p for _, p in paths]

    def covered(p: str) -> bool:
        inside = (CH_HOST_TMP, *(q for q in bound if q != p))
        return p == CH_HOST_TMP or any(p.startswith(q.rstrip("/") + "/") for q in inside)

    return [(key, p) for key, p in paths
            if not covered(p) and not os.path.isdir(os.path.join(image, p.lstrip("/")))]
