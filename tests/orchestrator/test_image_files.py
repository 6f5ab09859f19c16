"""Images (issue 52 item 11): an image file is what its runtime starts, by its header, and whole; an image
reference is read from the command line as docs/cluster.md writes it.

The files in tests/orchestrator/images/ are made by the real tools, not transcribed: tiny.sqsh by
mksquashfs 4.5.1 (Debian bookworm) of a folder holding etc/hello, tiny.sif by siftool 2.8.3 (Debian's
package of apptainer/sif: ``siftool new``, then ``siftool add tiny.sif tiny.sqsh --datatype 4 --parttype 2
--partfs 1 --partarch 2``), whose launch line is zeros where ``apptainer build`` writes
"#!/usr/bin/env run-singularity".
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.base.overrides import quote_image_refs
from orchestrator.base.plan_types import Context
from orchestrator.checks.container import image_problems
from orchestrator.world.container import image_file_format
from tests.orchestrator.conftest import REPO, compose_cfg

IMAGES = Path(__file__).parent / "images"
SIF, SQSH = IMAGES / "tiny.sif", IMAGES / "tiny.sqsh"


def _problems(tmp_path: Path, container: str, image: Path) -> list:
    cfg = compose_cfg(["+experiment=codeparrot_smoke", "cluster=devcluster", f"container={container}",
                       f"container.image={image}", f"runs_root={tmp_path}/runs"])
    return image_problems(Context(cfg))


def _cut(tmp_path: Path, src: Path, keep: int) -> Path:
    out = tmp_path / f"cut-{keep}{src.suffix}"
    out.write_bytes(src.read_bytes()[:keep])
    return out


def test_the_real_tools_images_are_what_their_headers_say():
    assert image_file_format(str(SIF)) == ("sif", "")
    assert image_file_format(str(SQSH)) == ("squashfs", "")


def test_apptainer_takes_a_sif_or_a_squashfs_image(tmp_path):
    assert _problems(tmp_path, "apptainer_ngc", SIF) == []
    assert _problems(tmp_path, "apptainer_ngc", SQSH) == []  # apptainer exec runs a bare squashfs image


def test_a_five_byte_text_file_is_no_sif(tmp_path):
    fake = tmp_path / "slipway.sif"
    fake.write_text("hello")
    [p] = _problems(tmp_path, "apptainer_ngc", fake)
    assert p.code == "container_image_format" and p.key == "container.image"
    assert "neither a SIF image (no SIF_MAGIC at byte 32) nor a squashfs one" in p.message
    assert "containers/build.sh" in p.fix


@pytest.mark.parametrize("container,src,keep,said", [
    ("apptainer_ngc", SIF, 20000, "its SIF header says 36864 bytes, the file has 20000"),
    ("apptainer_ngc", SQSH, 2048, "its superblock says 257 bytes"),  # mksquashfs pads to 4 KiB: 257 used
    ("pyxis", SQSH, 200, "its superblock says 257 bytes, the file has 200"),
    ("pyxis", SQSH, 30, "superblock is cut short (30 bytes)"),
])
def test_an_image_cut_short_is_refused(tmp_path, container, src, keep, said):
    """An interrupted copy keeps the header: the length the header states is longer than the file."""
    image = _cut(tmp_path, src, keep)
    problems = _problems(tmp_path, container, image)
    if said.startswith("its superblock says 257") and keep >= 257:
        assert problems == []  # only the padding is missing: the image is whole
        return
    [p] = problems
    assert p.code == "container_image_format" and said in p.message, p
    assert "copy the image again" in p.fix


def test_pyxis_refuses_a_sif_and_an_old_squashfs(tmp_path):
    [p] = _problems(tmp_path, "pyxis", SIF)
    assert "is not a squashfs file" in p.message
    old = tmp_path / "old.sqsh"
    data = bytearray(SQSH.read_bytes())
    data[28:30] = (3).to_bytes(2, "little")  # a squashfs 3.x superblock's major version
    old.write_bytes(bytes(data))
    [p] = _problems(tmp_path, "pyxis", old)
    assert "squashfs version 3, not 4" in p.message


def test_the_real_squashfs_tools_write_what_the_check_reads(tmp_path):
    """A fresh mksquashfs image, where mksquashfs is installed (containers/dev_image.py installs it)."""
    if shutil.which("mksquashfs") is None:
        pytest.skip("mksquashfs is not installed (squashfs-tools)")
    (tmp_path / "root" / "etc").mkdir(parents=True)
    (tmp_path / "root" / "etc" / "hello").write_text("slipway\n" * 5000)
    image = tmp_path / "fresh.sqsh"
    subprocess.run(["mksquashfs", str(tmp_path / "root"), str(image), "-quiet", "-noappend"], check=True,
                   capture_output=True, timeout=120)
    assert image_file_format(str(image)) == ("squashfs", "")
    assert "cut short" in image_file_format(str(_cut(tmp_path, image, 100)))[1]


# ----- the command line ----------------------------------------------------------------------------------

REF = "registry.example.org#team/slipway:1.0"


def test_an_image_reference_is_read_as_written_and_as_quoted():
    assert quote_image_refs([f"container.image={REF}", "optim.lr=3e-4"]) == [f"container.image='{REF}'",
                                                                           "optim.lr=3e-4"]
    for kept in (f'container.image="{REF}"', "container.image=/shared/s.sqsh", f"container.image={REF},x:1",
                 "cluster.time=48:00:00"):
        assert quote_image_refs([kept]) == [kept]


def _documented() -> list[list[str]]:
    """docs/cluster.md's launch lines that give container.image a reference with '#', split as a shell
    would."""
    page = (REPO / "docs" / "cluster.md").read_text(encoding="utf-8")
    lines = [ln for block in re.findall(r"```bash\n(.*?)```", page, re.S) for ln in block.splitlines()
             if ln.startswith("python launch.py") and "container.image=" in ln and "#" in ln]
    return [shlex.split(ln) for ln in lines]


def test_the_documented_spellings_reach_the_job_scripts(tmp_path):
    """Each documented spelling, exactly as the shell hands it to launch.py (a dry run, on a site of its
    own): Hydra reads it and the training job's srun names the image."""
    spellings = _documented()
    assert len(spellings) == 2, spellings  # as written, and quoted for Hydra
    conf = tmp_path / "conf" / "cluster"
    conf.mkdir(parents=True)
    (conf / "mysite.yaml").write_text("defaults:\n  - slurm\n  - _self_\npartition: gpu\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sinfo").write_text("#!/bin/bash\nexit 1\n")  # no Slurm here: the plan, not the cluster
    (bin_dir / "sinfo").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "WANDB_MODE": "offline"}
    for argv in spellings:
        assert argv[:2] == ["python", "launch.py"]
        args = [*argv[2:], f"hydra.searchpath=[file://{tmp_path / 'conf'}]", f"runs_root={tmp_path}/runs"]
        out = subprocess.run([sys.executable, "launch.py", *args], cwd=REPO, capture_output=True, text=True,
                             timeout=240, env=env)
        assert "OverrideParseException" not in out.stderr and "Could not parse" not in out.stderr, out.stderr
        train = out.stdout.split("----- train job script -----")[1]
        assert f"--container-image={REF}" in train, out.stdout[-3000:] + out.stderr[-2000:]
