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
from orchestrator.base.problems import PlanError
from orchestrator.launch.flow import launch
from orchestrator.readback.status import launch_notes
from orchestrator.record.launches import all_jobs, current, history
from orchestrator.world import queue
from tests.orchestrator.conftest import REPO, compose_cfg
from tests.orchestrator.devcluster_helpers import TINY_MODEL, wait_for
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

    # `python -m orchestrator cancel RUN`: every queued job of the run, in one scancel, recorded.
    capsys.readouterr()
    assert status_main(["cancel", str(run)]) == 0
    said = capsys.readouterr().out
    for stage, entries in jobs_1.items():
        assert f"run hist: {stage} job {entries[-1]['job_id']} cancelled (scancel)" in said, said
    wait_for(lambda: not _queued(run), 60, "the cancelled jobs to leave the queue")
    marked = current(json.loads((run / "run.json").read_text()))["cancelled"]
    assert marked == sorted(str(es[-1]["job_id"]) for es in jobs_1.values()), marked
    assert status_main(["cancel", str(run)]) == 0
    assert "nothing to cancel" in capsys.readouterr().out
    second = _overrides(tmp_path, run_id, "train.iters=7")
    launch(compose_cfg(second), out=io.StringIO(), overrides=tuple(second))
    _cancel(run)

    after = json.loads((run / "run.json").read_text())
    runs = history(after)
    assert [r["n"] for r in runs] == [1, 2]
    old = {k: v for k, v in runs[0].items() if k not in ("outcome", "cancelled")}
    assert old == current(before)  # launch 1's record as it wrote it: only its outcome (and what
    # `cancel` cancelled) were added
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


STAGES = ("corpus", "preprocess", "train")
# Every step boundary of a submission: each stage's intent, its sbatch, its record; before and after all.
STEPS = ["recorded", *(f"{w}:{stage}" for stage in STAGES for w in ("before_sbatch", "after_sbatch",
                                                                    "after_record")), "submitted"]


def _crash(tmp_path: Path, step: str) -> tuple[Path, list[str], dict]:
    """launch.py SIGKILLed by the failpoint at ``step``; (run dir, overrides, the dead launch's run.json)."""
    run_id = "crash"
    run = tmp_path / "runs" / "codeparrot_smoke" / run_id
    over = _overrides(tmp_path, run_id)
    env = dict(os.environ, **hook_env(LAUNCH_FAILPOINT=step))
    res = subprocess.run([sys.executable, "launch.py", *over], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env=env)
    assert res.returncode == -9, res.stdout + res.stderr[-3000:]
    return run, over, json.loads((run / "run.json").read_text())


def _only_the_unrecorded_job_live(run: Path, dead: dict) -> None:
    """Let the jobs the dead launch recorded run to completion, so the job it submitted without recording
    is the only live one (still held by its begin time): then nothing but the adoption of that job stands
    between a relaunch and a second copy of it."""
    recorded = [str(es[-1]["job_id"]) for es in current(dead).get("jobs", {}).values() if es]
    if not recorded:
        return
    for jid in recorded:
        slurm("scontrol", "update", f"JobId={jid}", "StartTime=now")

    def finished() -> bool:
        acct = slurm("sacct", "-n", "-X", "-P", "-j", ",".join(recorded), "-o", "JobIDRaw,State")
        states = dict(line.split("|", 1) for line in acct.splitlines() if "|" in line)
        assert not any(s.startswith(("FAILED", "CANCELLED")) for s in states.values()), states
        return len(states) == len(recorded) and all(s == "COMPLETED" for s in states.values())

    wait_for(finished, what=f"the dead launch's recorded jobs {recorded} to complete")


def _relaunch_after_crash(tmp_path: Path, step: str) -> tuple[Path, dict, dict[str, list[str]], str | None]:
    """Crash at ``step``, then relaunch in this process; (run, the dead record, live jobs by stage before
    the relaunch, the relaunch's refusal or None)."""
    run, over, dead = _crash(tmp_path, step)
    if step != "submitted":
        assert launch_notes(str(run))[-1].startswith("LAUNCH INCOMPLETE: run crash launch 1")
    if step.startswith("after_sbatch:"):
        _only_the_unrecorded_job_live(run, dead)
    before = _queued(run)
    try:
        launch(compose_cfg(over), out=io.StringIO(), overrides=tuple(over))
        refused = None
    except PlanError as err:
        refused = str(err)
    return run, dead, before, refused


def _violations(run: Path) -> list[str]:
    """What breaks "never two live jobs for a stage, never an unrecorded one" (empty: nothing)."""
    queued = _queued(run)
    recorded = {str(e["job_id"]) for _, _, e in all_jobs(json.loads((run / "run.json").read_text()))}
    return ([f"two live {s} jobs: {ids}" for s, ids in queued.items() if len(ids) > 1]
            + [f"unrecorded live job {j}" for ids in queued.values() for j in ids if j not in recorded])


@pytest.mark.parametrize("step", STEPS)
def test_a_launcher_killed_at_a_step_boundary_never_doubles_or_loses_a_job(tmp_path, step):
    try:
        run, dead, before, refused = _relaunch_after_crash(tmp_path, step)
        assert _violations(run) == []
        if before:  # the dead launch's jobs are live: refused, naming them, nothing submitted
            assert refused and "[run_active]" in refused, refused
            assert all(j in refused for ids in before.values() for j in ids), refused
            assert _queued(run) == before
        else:  # nothing of it reached the queue: the relaunch submits the whole graph
            assert refused is None and set(_queued(run)) == set(STAGES)
        if step != "submitted":
            assert history(json.loads((run / "run.json").read_text()))[0]["state"] == "incomplete"
        assert len(current(dead).get("pending", {})) <= 1
    finally:
        _cancel(tmp_path / "runs" / "codeparrot_smoke" / "crash")


@pytest.mark.parametrize("step", [f"after_sbatch:{stage}" for stage in STAGES])
def test_the_crash_test_fails_without_the_adoption_of_a_dead_launchs_job(tmp_path, step, monkeypatch):
    """The same case with the relaunch blind to the dead launch's queued job (the queue asked by comment
    finds nothing): a second live job, exactly what the test above guards against, at every sbatch."""
    monkeypatch.setattr(queue, "jobs_by_comment", lambda comments: {})
    try:
        run, _, before, refused = _relaunch_after_crash(tmp_path, step)
        stage = step.split(":")[1]
        assert refused is None and len(before.get(stage, [])) == 1, (refused, before)
        assert f"two live {stage} jobs" in " ".join(_violations(run)), _queued(run)
    finally:
        _cancel(tmp_path / "runs" / "codeparrot_smoke" / "crash")
