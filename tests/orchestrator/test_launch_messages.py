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
                    "MessageTimeout=1\n"  # each client call gives up in 1 s, not 9 s (the answer is the same)
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


# --- issue 52 item 7: Hydra's own refusals, said as Slipway's problems with their fix ---------------------

@pytest.mark.parametrize("override,fix", [
    ("cluster.time=48:00:00", "Fix: did you mean cluster.time_limit_min=2880 (48:00:00 in minutes)?"),
    ("optim.lrr=3e-4", "Fix: did you mean optim.lr=3e-4?"),
])
def test_an_unknown_key_without_plus_gets_the_did_you_mean_of_the_plus_form(tmp_path, override, fix):
    """Hydra refused these itself ("Could not override ... To append to your config use +key=value": advice
    the schema then refuses) before Slipway saw them."""
    res = _launch_py("+experiment=codeparrot", override, "dry_run=true", f"runs_root={tmp_path}/runs")
    text = _refused(res, "unknown_key")
    assert f"[unknown_key] {override.split('=')[0]}=" in text and fix in text, text
    assert "Could not override" not in text and "To append to your config" not in text
    assert not (tmp_path / "runs").exists()


def test_a_slurm_time_where_minutes_go_says_how_many_minutes(tmp_path):
    res = _launch_py("+experiment=codeparrot", "cluster.time_limit_min=48:00:00", "dry_run=true")
    text = _refused(res, "type")
    assert ("[type] cluster.time_limit_min='48:00:00': must be an integer number of minutes (48:00:00 = "
            "2880). Fix: cluster.time_limit_min=2880") in text, text
    res = _launch_py("+experiment=codeparrot", "train.iters=lots", "dry_run=true")
    assert "[type] train.iters='lots': must be an integer" in _refused(res, "type")


def test_other_hydra_errors_keep_hydras_text_and_a_users_full_error_its_traceback():
    res = _launch_py("+experiment=codeparrot", "cluster=mysit", "dry_run=true")
    assert res.returncode == 1 and "Could not find 'cluster/mysit'" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and "HYDRA_FULL_ERROR=1" in res.stderr
    env = {**os.environ, "HYDRA_FULL_ERROR": "1"}
    res = _launch_py("+experiment=codeparrot", "cluster.time=48:00:00", "dry_run=true", env=env)
    assert res.returncode == 1 and "Traceback" in res.stderr and "Could not override" in res.stderr


def test_hydras_switch_is_out_of_the_environment_before_jobs_are_submitted(monkeypatch):
    """launch.py sets HYDRA_FULL_ERROR to get Hydra's errors back; jobs inherit the launcher's environment,
    so it is gone again once the configs are composed; a user's own setting stays."""
    from orchestrator.launch import hydra_errors

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with hydra_errors.raised() as ours:
        assert ours and os.environ["HYDRA_FULL_ERROR"] == "1"
        hydra_errors.composed()
        assert "HYDRA_FULL_ERROR" not in os.environ
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with hydra_errors.raised() as ours:
        hydra_errors.composed()
        assert not ours and os.environ["HYDRA_FULL_ERROR"] == "1"


_SEES = """
import os, runpy, sys
from orchestrator.launch import flow, sweep
def sees(p, *a, **k):
    sys.stderr.write(f"SWITCH={os.environ.get('HYDRA_FULL_ERROR')}\\n")
    return flow.LaunchResult(p.plan, "", [])
def launch(cfg, *a, **k):
    return sees(flow.prepare(cfg))
flow.launch, sweep.execute = launch, sees
sys.argv = ["launch.py", *sys.argv[1:]]
runpy.run_path("launch.py", run_name="__main__")
"""


@pytest.mark.parametrize("multirun", [False, True])
def test_the_launch_itself_runs_without_hydras_switch(tmp_path, multirun):
    """What launch.py submits (a single run, or a sweep's points after every one was composed) runs with
    HYDRA_FULL_ERROR out of the environment again (stand-ins record the environment they submit in)."""
    args = [*SMOKE, f"runs_root={tmp_path}/runs", "wait=false"]
    if multirun:
        args = ["-m", *args, "optim.lr=1e-3,2e-3", f"hydra.sweep.dir={tmp_path}/sweep"]
        (tmp_path / "sweep").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    res = subprocess.run([sys.executable, "-c", _SEES, *args], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.count("SWITCH=None") == (2 if multirun else 1), res.stderr[-3000:]
