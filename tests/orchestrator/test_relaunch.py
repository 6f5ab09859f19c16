"""Relaunching a run on the devcluster: the launch history is append-only, a dry run refuses an active run,
and a launcher killed at any step boundary of a submission never leaves a job doubled or unrecorded.

The jobs are submitted to begin in an hour (``--begin``): they stay PENDING and never run, so each case
costs only its launches. The launcher is killed by the test-only failpoint ``SLIPWAY_LAUNCH_FAILPOINT`` (with
the switch ``SLIPWAY_TESTING=1``), exactly where a login shell dying would stop it.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.__main__ import main as status_main
from orchestrator.flow import launch
from orchestrator.launches import all_jobs, current, history
from orchestrator.problems import PlanError
from orchestrator.status import launch_notes
from tests.orchestrator.conftest import REPO, compose_cfg
from tests.orchestrator.devcluster_helpers import TINY_MODEL, newest_job_id, wait_for
from tests.seam import hook_env
from tests.slurm_cli import slurm

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]

HELD = [
    "+experiment=codeparrot_smoke",
    "cluster=devcluster",
    "data.corpus.max_files=12",
    "tokenizer.vocab_size=300",
    *TINY_MODEL,
    "convert.enabled=false",
    "logging.wandb.mode=disabled",
    "wait=false",
    "+cluster.sbatch_extra.begin=now+3600",  # PENDING (BeginTime) until cancelled: nothing runs
]


def _overrides(root: Path, run_id: str, *extra: str) -> list[str]:
    return [*HELD, f"runs_root={root}/runs", f"cache_dir={root}/cache", f"run_id={run_id}", *extra]


def _queued(run_dir: Path) -> dict[str, list[str]]:
    """{stage: [ids]} of this run's queued or running jobs, found by the comment its jobs carry."""
    out: dict[str, list[str]] = {}
    if not (run_dir / "run.json").exists():
        return out
    prefix = next(iter(_scripts_comment(run_dir)), None)
    for line in slurm("squeue", "-h", "-o", "%i|%T|%k").splitlines():
        jid, _, comment = line.split("|", 2)
        if prefix and comment.startswith(prefix):
            out.setdefault(comment.rsplit(":", 1)[1], []).append(jid)
    return out


def _scripts_comment(run_dir: Path) -> set[str]:
    """The run's comment prefix as the recorded scripts carry it (slipway:<digest>:)."""
    meta = json.loads((run_dir / "run.json").read_text())
    return {line.split("=", 1)[1].rsplit(":", 2)[0] + ":" for r in history(meta)
            for text in (r.get("scripts") or {}).values() for line in text.splitlines()
            if line.startswith("#SBATCH --comment=")}


def _cancel(run_dir: Path) -> None:
    ids = [j for js in _queued(run_dir).values() for j in js]
    if ids:
        slurm("scancel", *ids)
        wait_for(lambda: not _queued(run_dir), 60, "the cancelled jobs to leave the queue")


def test_relaunch_appends_to_the_history_and_keeps_earlier_launches(tmp_path, capsys):
    run = tmp_path / "runs" / "codeparrot_smoke" / "hist"
    try:
        _history_case(tmp_path, run, capsys)
    finally:
        _cancel(run)


def _history_case(tmp_path, run, capsys):
    run_id = run.name
    first = _overrides(tmp_path, run_id, "train.iters=5")
    launch(compose_cfg(first), out=io.StringIO(), overrides=tuple(first))
    before = json.loads((run / "run.json").read_text())
    config_1 = (run / "launches" / "001" / "config.yaml").read_text()
    jobs_1 = current(before)["jobs"]
    assert set(jobs_1) == {"corpus", "preprocess", "train"}

    # A dry run while the run's jobs are queued says [run_active], as the real launch would.
    dry = compose_cfg([*first, "dry_run=true"])
    res = launch(dry, out=io.StringIO())
    assert [p.code for p in res.plan.problems] == ["run_active"]
    assert f"train job {jobs_1['train'][-1]['job_id']}" in str(res.plan.problems[0])

    _cancel(run)
    second = _overrides(tmp_path, run_id, "train.iters=7")
    launch(compose_cfg(second), out=io.StringIO(), overrides=tuple(second))
    _cancel(run)

    after = json.loads((run / "run.json").read_text())
    runs = history(after)
    assert [r["n"] for r in runs] == [1, 2]
    old = {k: v for k, v in runs[0].items() if k not in ("outcome",)}
    assert old == current(before)  # launch 1's record as it wrote it: only its outcome was added
    assert runs[0]["outcome"] == {"corpus": "CANCELLED", "preprocess": "CANCELLED", "train": "CANCELLED"}
    assert "train.iters=5" in runs[0]["overrides"] and "train.iters=7" in runs[1]["overrides"]
    assert runs[1]["jobs"]["train"][-1]["job_id"] != jobs_1["train"][-1]["job_id"]
    assert (run / "launches" / "001" / "config.yaml").read_text() == config_1  # never rewritten
    assert "iters: 5" in config_1 and "iters: 7" in (run / "config.yaml").read_text()  # the link: latest
    assert (run / "config.yaml").resolve() == (run / "launches" / "002" / "config.yaml").resolve()

    capsys.readouterr()
    assert status_main(["status", str(run), "--history"]) == 0
    text = capsys.readouterr().out
    for r in runs:
        assert f"launch {r['n']}" in text and f"train={r['jobs']['train'][-1]['job_id']}" in text
    assert "train=CANCELLED" in text


STEPS = ["recorded", "before_sbatch:corpus", "before_sbatch:train", "after_sbatch:train",
         "after_record:train", "submitted"]


@pytest.mark.parametrize("step", STEPS)
def test_a_launcher_killed_at_a_step_boundary_never_doubles_or_loses_a_job(tmp_path, step):
    run_id = "crash"
    run = tmp_path / "runs" / "codeparrot_smoke" / run_id
    over = _overrides(tmp_path, run_id)
    env = dict(os.environ, **hook_env(LAUNCH_FAILPOINT=step))
    res = subprocess.run([sys.executable, "launch.py", *over], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env=env)
    try:
        assert res.returncode == -9, res.stdout + res.stderr[-3000:]
        dead = json.loads((run / "run.json").read_text())
        if step != "submitted":
            assert launch_notes(str(run))[-1].startswith("LAUNCH INCOMPLETE: run crash launch 1")
        queued_by_dead = _queued(run)
        newest = newest_job_id()

        try:
            launch(compose_cfg(over), out=io.StringIO(), overrides=tuple(over))
            refused = None
        except PlanError as err:
            refused = str(err)
        queued = _queued(run)
        assert all(len(ids) == 1 for ids in queued.values()), queued  # never two live jobs for a stage
        recorded = {str(e["job_id"]) for _, _, e in all_jobs(json.loads((run / "run.json").read_text()))}
        assert {j for ids in queued.values() for j in ids} <= recorded  # never an unrecorded one
        if queued_by_dead:  # the dead launch's jobs are live: refused, naming them, nothing submitted
            assert refused and "[run_active]" in refused, refused
            assert all(j in refused for ids in queued_by_dead.values() for j in ids), refused
            assert newest_job_id() == newest
        else:  # nothing reached the queue: the relaunch submits the whole graph
            assert refused is None and set(queued) == {"corpus", "preprocess", "train"}
        if step != "submitted":
            assert history(json.loads((run / "run.json").read_text()))[0]["state"] == "incomplete"
        assert len(current(dead).get("pending", {})) <= 1
    finally:
        _cancel(run)
