"""The devcluster guard of tests/conftest.py fires: with CI set and Slurm unreachable, a ``slurm`` test
fails (it is not skipped, and it does not run), before any of its fixtures; without CI it is skipped.

Each case runs pytest in a subprocess with ``SLURM_CONF`` pointing at a file that does not exist, so the
cluster of the surrounding suite (if any) is out of reach.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PROBE = '''
import pytest

@pytest.fixture(scope="session")
def submits_jobs(tmp_path_factory):
    # Stands for a session fixture that would submit jobs: the guard must speak before it runs.
    open({ran!r}, "w").write("ran")

@pytest.mark.slurm
def test_marked(submits_jobs):
    pass

@pytest.mark.slurm
class TestMarkedClass:
    def test_in_marked_class(self):
        pass

def test_slurm_in_name_only():
    pass
'''


def _pytest(args: list[str], tmp_path: Path, ci: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["SLURM_CONF"] = str(tmp_path / "no-such-cluster" / "slurm.conf")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    if ci:
        env["CI"] = "true"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _probe_args(probe: Path) -> list[str]:
    # -p tests.conftest: the probe lives outside tests/, so load the suite's policy explicitly.
    return ["-c", str(REPO / "pyproject.toml"), "-p", "tests.conftest", str(probe)]


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    path = tmp_path / "test_probe.py"
    path.write_text(PROBE.format(ran=str(tmp_path / "fixture_ran")))
    return path


def test_ci_fails_a_real_slurm_test_when_the_cluster_is_unreachable(tmp_path):
    test = "tests/slurm/test_devcluster.py::test_srun_runs_one_task_on_each_node_and_sacct_records_it"
    res = _pytest([test], tmp_path, ci=True)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "1 error" in res.stdout and "passed" not in res.stdout and "skipped" not in res.stdout, res.stdout
    assert "CI is set, so the devcluster is required" in res.stdout, res.stdout


def test_ci_fails_marked_tests_before_their_fixtures_and_leaves_unmarked_ones(tmp_path, probe):
    res = _pytest(_probe_args(probe), tmp_path, ci=True)
    out = res.stdout
    assert res.returncode == 1, out + res.stderr
    assert "ERROR" in out and "ERROR ::test_marked - Failed: CI is set" in out, out
    assert "ERROR ::TestMarkedClass::test_in_marked_class - Failed" in out, out
    assert "2 errors" in out and "1 passed" in out, out  # a name containing "slurm" is not the marker
    assert not (tmp_path / "fixture_ran").exists(), "the session fixture ran before the guard failed the test"


def test_without_ci_an_unreachable_cluster_skips(tmp_path, probe):
    res = _pytest(_probe_args(probe), tmp_path, ci=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "2 skipped" in res.stdout and "1 passed" in res.stdout, res.stdout
    assert "devcluster not available" in res.stdout, res.stdout


def test_ci_run_sets_ci_itself_before_make_test():
    """The guard must not depend on the CI runner exporting CI: .ci/run sets it before `make test`."""
    lines = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines()]
    assert "export CI=true" in lines and "make test" in lines
    assert lines.index("export CI=true") < lines.index("make test")
