"""The smoke pipeline end to end inside a real container runtime on the devcluster: corpus -> preprocess ->
train (tp 2 x pp 2 on 2 nodes, each a host of its own: slurm/devcluster_lib/hosts.py) -> convert -> eval,
every task in the image, once through pyxis + enroot (``container=pyxis``: srun's --container-* flags, the
image as a squashfs file; the devcluster loads them where they are installed,
slurm/devcluster_lib/pyxis.py) and once through Charliecloud's ch-run (``container=charliecloud``: the per-
task wrapper, as Apptainer's).

The image (containers/dev_image.py; ``make test`` builds it, cached by its inputs) has its own Python
(Debian's 3.11), its own CPU torch and Slipway's kernels built inside it at /opt/slipway. The run is
launched from a checkout whose kernel build does not match the image: a library named for the image's
Python (cp311), first on PYTHONPATH, that needs a symbol the image's torch does not have, as a build made
on the login node against another torch does (a stand-in compiled here: importing it fails with
"undefined symbol", as such a build's import does). With e37144f's loader the ranks import it, fail, and
train on eager fallbacks ("Fix: run `make install`"). Every training rank must report (metrics file:
kernel_builds) the image's build, loaded by the image's Python, running the checkout's code.

Apptainer cannot be installed here (docs/cluster.md says what these runs prove of it). As root (CI), the
launch sets ENROOT_ALLOW_SUPERUSER=yes, which pyxis reads from the job's environment: a site's root must
opt in too. Cost on two cores: ~20 s with Charliecloud, ~190 s with pyxis (enroot unpacks the image for
each step on each node); the image is built before the suite, minutes once per change of its inputs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.record.launches import current
from orchestrator.world.container import PYXIS_OPTIONS
from tests.ci import IN_CI
from tests.devcluster import node_addresses, settings
from tests.orchestrator.conftest import REPO
from tests.orchestrator.devcluster_helpers import TINY_MODEL, cancel_runs, wait_states
from trainer.metrics_file import KERNEL_BUILDS, read_records

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(1500)]

CHECKOUT = ("launch.py", "setup.py", "pyproject.toml", "orchestrator", "trainer", "hydra_conf",
            "hydra_plugins", "csrc")
IMAGE_BUILD = "/opt/slipway/trainer/_C.cpython-311-x86_64-linux-gnu.so"
IMAGE_PYTHON = "/opt/venv/bin/python"


def _pyxis_loaded() -> bool:
    """srun lists pyxis's options when the devcluster loaded the plugin (slurm/devcluster_lib/pyxis.py)."""
    shown = subprocess.run(["srun", "--help"], capture_output=True, text=True, timeout=60).stdout
    return all(option in shown for option in PYXIS_OPTIONS)


def _dev_image(runtime: str) -> Path:
    spec = importlib.util.spec_from_file_location("dev_image", REPO / "containers" / "dev_image.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = module.sqsh_path() if runtime == "pyxis" else module.path()
    if found is None:
        why = "the devcluster image is not built for this checkout: run containers/dev_image.py build"
        if IN_CI:
            pytest.fail(f"CI is set, so the container image is required ({why}; make test builds it)")
        pytest.skip(why)
    return found


# A library that loads only where a torch with this symbol is: what a build for another torch is in an image.
FOREIGN_BUILD = "extern void _ZN3c1021slipway_another_torchEv(void);\n" \
                "void *PyInit__C(void) { _ZN3c1021slipway_another_torchEv(); return 0; }\n"


def _checkout(dest: Path) -> Path:
    """A copy of this checkout (its own build left out) with a build that does not match the image."""
    def skip(folder: str, names: list[str]) -> list[str]:
        return [n for n in names if n == "__pycache__" or n.startswith("_C.")]

    for name in CHECKOUT:
        src = REPO / name
        shutil.copy2(src, dest / name) if src.is_file() else shutil.copytree(src, dest / name, ignore=skip)
    (dest / "foreign.c").write_text(FOREIGN_BUILD)
    library = dest / "trainer" / Path(IMAGE_BUILD).name  # the image's Python finds it first
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(dest / "foreign.c")], check=True,
                   timeout=120)
    return dest


@pytest.fixture(scope="module", params=["pyxis", "charliecloud"])
def run(request, tmp_path_factory):
    if request.param == "pyxis" and not _pyxis_loaded():
        # No package of pyxis or enroot exists for Debian, PyPI or npm (slurm/README.md): where a machine
        # has them installed, the devcluster loads them and this runs.
        pytest.skip("pyxis and enroot are not installed on this machine (slurm/README.md: the devcluster "
                    "loads them where they are)")
    image = _dev_image(request.param)
    root = tmp_path_factory.mktemp(request.param)
    (root / "checkout").mkdir()
    code = _checkout(root / "checkout")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if os.geteuid() == 0:
        env["ENROOT_ALLOW_SUPERUSER"] = "yes"
    args = ["+experiment=codeparrot_smoke", "cluster=devcluster", f"container={request.param}",
            f"container.image={image}", "data.corpus.max_files=12", "data.corpus.max_bytes=200000",
            "tokenizer.vocab_size=300", *TINY_MODEL, f"runs_root={root}/runs", f"cache_dir={root}/cache",
            "train.iters=4", "train.save_interval=2", "train.eval_interval=2", "wait=false"]
    out = subprocess.run([sys.executable, "launch.py", *args], cwd=code, capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run_dir = Path(next(line.split(": ", 1)[1] for line in out.stdout.splitlines()
                        if line.startswith("run dir: ")))
    try:
        yield run_dir
    finally:
        cancel_runs([run_dir])


def test_the_pipeline_runs_in_the_image(run):
    states = wait_states(run)
    logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in sorted((run / "logs").glob("*.err")))
    assert set(states.values()) == {"COMPLETED"} and len(states) == 5, (states, logs)
    stages = current(json.loads((run / "run.json").read_text()))["stages"]
    assert all((Path(stages[s]["dir"]) / "_COMPLETE").exists() for s in ("corpus", "preprocess"))
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    done = json.loads((run / "stages" / "convert" / "_COMPLETE").read_text())
    assert "verification PASSED" in done["result"]["result"]
    results = json.loads((run / "eval" / "results.json").read_text())
    assert results["humaneval"]["problems"] > 0 and results["perplexity"]["heldout"]["tokens"] > 0
    # Each job ran its tasks in the image: through the wrapper and ch-run, or srun's pyxis flags.
    scripts = "\n".join(p.read_text() for p in (run / "launches").rglob("*")
                         if p.is_file() and "scripts" in p.parts)
    if (run / "container_exec.sh").exists():
        assert "ch-run --unset-env='*'" in (run / "container_exec.sh").read_text()
    else:
        assert scripts.count("--container-image=") >= 3 and ".sqsh" in scripts, scripts[-3000:]
    if settings().hosts:  # the ranks, in the image, on two nodes that are hosts of their own
        ranks = json.loads((run / "preflight.json").read_text())["ranks"]
        assert sorted((r["node"], r["host"]) for r in ranks) == [("n1", "n1")] * 2 + [("n2", "n2")] * 2, ranks
        assert len({r["netns"] for r in ranks}) == 2 and {r["master"] for r in ranks} == \
            {node_addresses()["n1"]}, ranks


def test_every_rank_loaded_the_images_kernels_with_the_images_python(run):
    wait_states(run)
    builds = next((r[KERNEL_BUILDS] for r in read_records(str(run)) if KERNEL_BUILDS in r), [])
    assert len(builds) == 4, builds  # tp 2 x pp 2
    code = str(run.parents[2] / "checkout" / "trainer")  # <root>/runs/<experiment>/<run id>
    for b in builds:
        assert b["ok"] and b["image"] and b["path"] == IMAGE_BUILD, builds
        assert b["python"] == IMAGE_PYTHON and b["python"] != sys.executable, builds
        assert b["code"] == code, builds  # the launched checkout's Python code, the image's kernels
    logs = "\n".join(p.read_text() for p in (run / "logs").glob("train_*.err"))
    assert "eager fallbacks" not in logs and "undefined symbol" not in logs
