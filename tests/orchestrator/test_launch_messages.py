"""Conditions a user causes end in one line with its fix, found before anything is recorded or submitted
(the dry run finds them too), never in launch.py's "launch failed unexpectedly" and a traceback: a
runs_root that cannot be written or created, a Slurm controller that does not answer, and an sbatch that
refuses a job."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ci import skip_unless_ci
from tests.orchestrator.conftest import REPO
from tests.orchestrator.devcluster_helpers import TINY_MODEL, newest_job_id

SMOKE = ["+experiment=codeparrot_smoke", "logging.wandb.mode=disabled", "run_id=r"]
UNEXPECTED = "launch failed unexpectedly"


def _launch_py(*args: str, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "launch.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env=env)


def _refused(res: subprocess.CompletedProcess, code: str) -> str:
    """launch.py exited 2 (configuration problems) listing ``code``, with no traceback."""
    text = res.stdout + res.stderr
    assert res.returncode == 2, text[-3000:]
    assert "Traceback" not in text and UNEXPECTED not in text, text[-3000:]
    assert f"[{code}]" in text or f"- [{code}]" in text, text[-3000:]
    return text


@pytest.fixture
def read_only(tmp_path) -> Path:
    """A read-only filesystem (tmpfs mounted ro; CI runs as root): root ignores permission bits, not this."""
    mnt = tmp_path / "ro"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        skip_unless_ci(f"cannot mount a read-only tmpfs here (not root?): {done.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], capture_output=True)


@pytest.mark.parametrize("dry", [True, False])
def test_a_runs_root_on_a_read_only_filesystem_is_a_problem_line(tmp_path, read_only, dry):
    res = _launch_py(*SMOKE, f"runs_root={read_only}/runs", f"cache_dir={tmp_path}/cache",
                     *(["dry_run=true"] if dry else []))
    text = _refused(res, "storage")
    assert f"runs_root='{read_only}/runs': {read_only}/runs/codeparrot_smoke/r is where the run writes, " \
           f"but {read_only} is on a read-only filesystem, so it cannot be created" in text, text[-3000:]
    assert text.count("[storage]") == 1  # its checkpoints and cache are under the same read-only folder
    assert "Fix: set runs_root to a folder you can write that every node sees" in text


def test_a_runs_root_behind_a_file_and_an_unwritable_cache_are_refused_at_once(tmp_path, read_only):
    (tmp_path / "afile").write_text("not a folder\n")
    res = _launch_py(*SMOKE, f"runs_root={tmp_path}/afile/runs", f"cache_dir={read_only}/cache")
    text = _refused(res, "storage")
    assert f"{tmp_path}/afile is a file, not a folder, so it cannot be created" in text, text[-3000:]
    assert text.count("[storage]") == 2
    assert f"cache_dir='{read_only}/cache'" in text and "read-only filesystem" in text
    assert not (tmp_path / "cache").exists()


def test_a_checkpoint_dir_that_cannot_be_written_is_refused_on_its_own(tmp_path, read_only):
    """runs_root and cache_dir writable, only checkpoint.dir (a shared scratch, say) read-only: the dry run
    names that key, not the run directory, before any job would fail at its first save."""
    res = _launch_py(*SMOKE, f"runs_root={tmp_path}/runs", f"cache_dir={tmp_path}/cache",
                     f"checkpoint.dir={read_only}/ckpt", "dry_run=true")
    text = _refused(res, "storage")
    assert text.count("[storage]") == 1, text[-3000:]
    assert f"checkpoint.dir='{read_only}/ckpt': {read_only}/ckpt is where the run writes, but {read_only} " \
           "is on a read-only filesystem" in text, text[-3000:]
    assert "Fix: set checkpoint.dir to a folder you can write that every node sees" in text


@pytest.mark.parametrize("dry", [True, False])
def test_a_slurm_controller_that_does_not_answer_is_a_problem_line(tmp_path, dry):
    """A slurm.conf whose controller port nobody listens on: sinfo cannot reach slurmctld."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=nowhere\nSlurmctldHost=localhost\nSlurmctldPort=6\nAuthType=auth/munge\n"
                    "NodeName=n9 CPUs=1 State=UNKNOWN\nPartitionName=p Nodes=n9 Default=YES\n")
    env = dict(os.environ, SLURM_CONF=str(conf))
    res = _launch_py(*SMOKE, "cluster=devcluster", f"runs_root={tmp_path}/runs", f"cache_dir={tmp_path}/c",
                     *(["dry_run=true"] if dry else []), env=env)
    text = _refused(res, "slurm_unreachable")
    assert "the Slurm controller does not answer (sinfo exited 1: slurm_load_partitions: Unable to contact " \
           "slurm controller" in text, text[-3000:]
    assert "scontrol ping" in text and "cluster=local" in text
    assert not (tmp_path / "runs").exists()  # nothing was recorded


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_an_sbatch_refusal_is_one_line_naming_the_stage(tmp_path):
    """Slurm itself refuses the first job (a node that does not exist): one line with Slurm's words, the
    stage, and that nothing was submitted; no second job reaches the queue."""
    newest = newest_job_id()
    res = _launch_py(*SMOKE, "cluster=devcluster", *TINY_MODEL, "data.corpus.max_files=12",
                     "tokenizer.vocab_size=300", "convert.enabled=false", "wait=false",
                     "+cluster.sbatch_extra.nodelist=nosuchnode", f"runs_root={tmp_path}/runs",
                     f"cache_dir={tmp_path}/c")
    text = res.stdout + res.stderr
    assert res.returncode == 2 and "Traceback" not in text and UNEXPECTED not in text, text[-3000:]
    assert "slipway: sbatch refused the corpus job: sbatch: error: " in text, text[-3000:]
    assert "nothing was submitted" in text and "launch again" in text
    assert newest_job_id() == newest


@pytest.mark.parametrize("size", ["model.hidden_size=0", "model.num_attention_heads=0", "model.num_layers=0",
                                  "model.seq_length=0", "parallel.pp_size=0"])
def test_a_size_of_zero_is_a_problem_line_not_a_division_by_zero(tmp_path, size):
    """The estimates divide by the model's sizes: with one at 0 the plan says so instead of crashing."""
    from orchestrator.launch.flow import launch
    from tests.orchestrator.conftest import compose_cfg

    out = io.StringIO()
    plan = launch(compose_cfg([*SMOKE, f"runs_root={tmp_path}", "dry_run=true", size]), out=out).plan
    assert any(p.code == "positive" and p.key == size.split("=")[0] for p in plan.problems), plan.problems
    assert "Memory: not estimated" in out.getvalue() and "Time: not estimated" in out.getvalue()
