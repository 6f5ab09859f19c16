"""The Apptainer definition file's structure and the build script (Apptainer is not installable here)."""

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
