"""A run directory written by the previous format (one launch: ``jobs``, ``config``, ``stages`` at the top
of run.json, a plain ``config.yaml``) still reads, and a relaunch converts it without losing that launch."""

from __future__ import annotations

import json

from orchestrator.__main__ import main as status_main
from orchestrator.record.launches import LaunchRecord, current, current_jobs, history, link_config


def _old_run(run):
    run.mkdir(parents=True)
    jobs = {"train": [{"job_id": "41", "executor": "local", "folder": str(run / "jobs" / "train")}]}
    old = {"run_id": "r1", "experiment": "smoke", "name": "r1", "created": "2026-01-01T00:00:00",
           "git": {"sha": "abc", "dirty": False}, "config": {"train": {"iters": 5}},
           "stages": {"train": {"key": "k", "dir": str(run / "stages" / "train")}}, "jobs": jobs}
    (run / "run.json").write_text(json.dumps(old))
    (run / "config.yaml").write_text("train:\n  iters: 5\n")
    return old


def test_previous_format_reads_as_one_launch_and_a_relaunch_keeps_it(tmp_path, capsys):
    run = tmp_path / "r1"
    old = _old_run(run)
    assert current_jobs(old) == old["jobs"] and len(history(old)) == 1
    assert status_main(["status", str(run), "--history"]) == 0
    assert "launch 1  2026-01-01T00:00:00  submitted" in capsys.readouterr().out

    n = LaunchRecord.load(run).begin({"run_id": "r1", "created": "later"}, {"overrides": ["train.iters=7"]})
    link_config(str(run), n).write_text("train:\n  iters: 7\n")
    new = json.loads((run / "run.json").read_text())
    assert n == 2 and new["created"] == old["created"] and new["format"] == 2
    first = history(new)[0]
    assert {k: first[k] for k in ("git", "config", "stages", "jobs")} == {k: old[k] for k in
                                                                         ("git", "config", "stages", "jobs")}
    assert current(new)["overrides"] == ["train.iters=7"] and current_jobs(new) == {}
    assert (run / "launches" / "001" / "config.yaml").read_text() == "train:\n  iters: 5\n"
    assert (run / "config.yaml").read_text() == "train:\n  iters: 7\n"


def test_a_dead_local_launch_is_settled_without_asking_a_queue(tmp_path):
    """A local launch killed before recording its job: its intent has no comment and there is no Slurm to
    ask; the relaunch marks it incomplete instead of failing on a missing squeue."""
    import subprocess
    import sys

    from orchestrator.world.runs import write_json

    run = tmp_path / "r"
    record = LaunchRecord.load(run)
    n = record.begin({"run_id": "r"}, {})
    record.record_intent(n, "corpus", "")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer exists: the launcher that wrote the record
    data = json.loads((run / "run.json").read_text())
    data["launches"][0]["pid"] = dead.pid
    write_json(run / "run.json", data)

    def no_queue(comments):
        raise AssertionError(f"asked the queue for {comments}")

    lines = LaunchRecord.load(run).reconcile(find=no_queue)
    assert lines == ["launch 1 died before recording its corpus job, and no job of it is queued or running "
                     "(never submitted, or already ended)"]
    after = history(json.loads((run / "run.json").read_text()))[0]
    assert after["state"] == "incomplete" and after["pending"] == {} and after["jobs"] == {}
