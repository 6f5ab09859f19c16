"""What the orchestrator's modules load: planning and the status table never load submitit (the stage
modules import it only inside their node-side calls), and no runtime module loads the config-reference
tool orchestrator/docs.py."""

from __future__ import annotations

import subprocess
import sys

from tests.orchestrator.conftest import REPO


def _loaded(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_planning_does_not_load_submitit():
    code = ("import sys, orchestrator.planning.plan, orchestrator.stages, orchestrator.readback.status, "
            "orchestrator.world.queue; print('submitit' in sys.modules)")
    assert _loaded(code).strip() == "False"


def test_runtime_does_not_load_the_docs_tool():
    runtime = ["launch", "orchestrator.launch.flow", "orchestrator.__main__", "orchestrator.readback.status",
               "orchestrator.stages"]
    code = "import sys, importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in runtime)
    assert _loaded(code + "print('orchestrator.docs' in sys.modules)").strip() == "False"
