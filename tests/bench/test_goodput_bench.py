"""bench/goodput.py end to end on the devcluster at its tiny size: both runs (synchronous and asynchronous
saves) launched for real, a rank SIGKILLed through the fault seam (retried in the allocation), a USR2
preemption (requeued: a second allocation), and the figures the bench commits computed from what the runs
left: the bench's arithmetic is checked here so its big run's numbers can be trusted (no timing goals)."""

from __future__ import annotations

import json

import pytest

from bench import goodput as bench

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(1500)]


def test_the_tiny_bench_runs_both_modes_and_reports_what_the_runs_did(tmp_path):
    out = tmp_path / "goodput.json"
    assert bench.main(["--tiny", "--root", str(tmp_path / "runs"), "--results", str(out), "--keep"]) == 0
    r = json.loads(out.read_text())
    assert r["disk"]["write_MBps"] > 0 and r["disk"]["read_MBps"] > 0
    for mode in ("sync", "async"):
        f = r[mode]
        # Attempts: the first crashes after 7 (the seam), its retry is preempted at 10 (USR2: a requeue),
        # the requeued job ends the run: 3 attempts in 2 allocations, each with a time to first step.
        jobs = [(a["job"], a["restart"], a["attempt"]) for a in f["attempts"]]
        assert len(jobs) == 3 and len({(j, rs) for j, rs, _ in jobs}) == 2, jobs
        assert all(a["to_first_step_s"] and a["to_first_step_s"] > 0 for a in f["attempts"]), f["attempts"]
        assert f["attempts"][0]["ended"] is None and f["attempts"][-1]["ended"] == 0, f["attempts"]
        assert 0 < f["goodput"] < 1 and f["lost_s"]["recompute"] > 0 and f["lost_s"]["restart"] > 0, f
        assert f["waiting_s"] >= 0 and f["lost_s"]["launch"] > 0, f  # the batch script's start is known
        assert {s["mode"] for s in f["saves"]} == {mode}, f["saves"]
        assert all(s["checkpoint_bytes"] and s["write_MBps"] for s in f["saves"] if s["write_s"]), f["saves"]
        # The retry after the crash loads the save at 4, except where an async save's background write was
        # still going at 7 (the crash ends it: the retry starts over; seen in CI); the requeue always loads.
        loads = {"sync": [2], "async": [1, 2]}[mode]
        assert len(f["loads"]) in loads and all(x["MBps"] > 0 for x in f["loads"]), f["loads"]
    s = r["summary"]
    assert s["blocked_sync_s"] > 0 and s["blocked_async_s"] > 0 and s["blocked_ratio"] > 0, s
    same = r["same_training"]
    assert same["losses_equal"] and same["iterations_compared"] == 12, same
    assert same["final_checkpoint_tensors_equal"], same
