"""The Apptainer definition file's structure and the build scripts (Apptainer and pyxis are not installable
here: the scripts run with stand-ins)."""

from __future__ import annotations

import re
import subprocess

from tests.orchestrator.conftest import REPO

DEF = REPO / "containers" / "slipway-ngc.def"


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^%(\w+)\s*$", text, flags=re.M)
    header, rest = parts[0], parts[1:]
    out = {"header": header}
    out.update({rest[i]: rest[i + 1] for i in range(0, len(rest), 2)})
    return out


def test_definition_pins_an_ngc_pytorch_image_and_builds_slipway():
    s = _sections(DEF.read_text())
    header = {k.strip(): v.strip() for k, v in re.findall(r"^(Bootstrap|From):\s*(\S+)", s["header"], re.M)}
    assert header["Bootstrap"] == "docker"
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", header["From"])  # pinned, no "latest"
    assert {"files", "post", "environment", "test", "labels"} <= set(s)
    post = s["post"]
    assert "--no-build-isolation" in post and "pip install" in post  # keeps the image's torch
    assert 'TORCH_CUDA_ARCH_LIST="8.0;9.0"' in post  # Ampere and Hopper kernels
    assert "import trainer._C, apex" in post  # the build fails without the extension or apex
    assert "/opt/slipway" in s["files"]


def test_build_script_is_valid_bash():
    script = REPO / "containers" / "build.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert "apptainer build" in text and "slipway-ngc.def" in text and "apptainer test" in text


def test_squashfs_build_reads_base_and_steps_from_the_definition(tmp_path):
    """containers/build_sqsh.sh with a stand-in srun: the base image is the .def's From (in enroot's
    REGISTRY#IMAGE form), the steps are its %post, the saved image is then self-tested with its %test."""
    import os

    srun = tmp_path / "srun"
    srun.write_text('#!/bin/bash\n[ "$1" = --help ] && { echo "  --container-save=PATH"; exit 0; }\n'
                    'printf "%s\\n" "$@" >> "$LOG"; echo "---" >> "$LOG"\n')
    srun.chmod(0o755)
    log = tmp_path / "log"
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", LOG=str(log))
    out = tmp_path / "s.sqsh"
    res = subprocess.run(["bash", str(REPO / "containers" / "build_sqsh.sh"), str(out), "-p", "gpu"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    build, check = [c.strip().splitlines() for c in log.read_text().split("---")[:2]]
    base = re.search(r"^From:\s*(\S+)", DEF.read_text(), re.M).group(1)
    assert f"--container-image={base.replace('/', '#', 1)}" in build and "-p" in build
    assert f"--container-save={out}" in build and "--container-remap-root" in build
    payload = "\n".join(build[build.index("-c") + 1:])
    assert "cp -a /src/. /opt/slipway" in payload and _sections(DEF.read_text())["post"].strip() in payload
    assert f"--container-image={out}" in check and "import trainer._C" in "\n".join(check)
