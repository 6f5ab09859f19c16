"""trainer.goodput: the accounting over a run's attempt records (two allocations, a retry inside the first,
a queue wait between them), each attempt's clock (every second in exactly one span; the first step is
start-up, a replayed iteration is recompute), crash tolerance of the records, and the status lines."""

from __future__ import annotations

import json
import os

import pytest

from orchestrator.readback.goodput import goodput_notes
from trainer.goodput import account, clock, format_lines, read_records
from trainer.goodput.clock import AttemptClock
from trainer.run_files import RunDir


def _rec(job, restart, attempt, alloc_start, start, updated, iteration, **seconds) -> dict:
    return {"job": job, "restart": restart, "attempt": attempt, "alloc_start": alloc_start,
            "process_start": start, "updated": updated, "iteration": iteration, "seconds": seconds,
            "first_step_end": start + 12.0, "save_totals": {"count": 2, "blocked_s": 1.0, "write_s": 6.0,
                                                            "bytes": 2 * 2**30, "async": 2}}


RECORDS = [
    # Allocation 1 (job 7, restart 0), granted at t=1000: attempt 0 crashed after iteration 30 ...
    _rec("7", "0", "0", 1000.0, 1010.0, 1110.0, 30, imports=5, setup=1, build=4, first_step=2,
         productive=70, checkpoint=8, evaluation=5),  # other: 100 - 95 = 5
    # ... the retry starts 10 s after its last record and replays iterations 21-30 (recompute).
    _rec("7", "0", "1", 1000.0, 1120.0, 1200.0, 60, imports=5, build=3, checkpoint_load=2, first_step=2,
         recompute=10, productive=50, checkpoint=4),  # other: 80 - 76 = 4
    # Allocation 2: requeued, queued 300 s, granted at t=1500, its process up at 1503.
    _rec("7", "1", "0", 1500.0, 1503.0, 1600.0, 80, imports=5, build=3, checkpoint_load=2, first_step=2,
         productive=80, step=1, shutdown=1),  # other: 97 - 92 = 5 (the open step, the shutdown)
]


def test_the_accounting_of_two_allocations_with_a_retry():
    g = account(RECORDS)
    assert (g.attempts, g.allocations) == (3, 2)
    assert g.allocated_s == pytest.approx(200 + 100)  # 1000 → 1200, 1500 → 1600; the queue is not in it
    assert g.waiting_s == pytest.approx(300)
    assert g.productive_s == pytest.approx(70 + 50 + 80)
    assert g.lost == pytest.approx({"launch": 10 + 3, "startup": 12 + 12 + 12, "checkpoint": 12,
                                    "evaluation": 5, "recompute": 10, "restart": 10, "other": 5 + 4 + 5})
    assert g.productive_s + sum(g.lost.values()) == pytest.approx(g.allocated_s)  # every second once
    assert g.fraction == pytest.approx(200 / 300)
    assert g.startup == pytest.approx({"imports": 15, "setup": 1, "build": 10, "checkpoint_load": 4,
                                       "first_step": 6})
    assert g.first_step_s == [12.0, 12.0, 12.0]
    lines = format_lines(g)
    assert lines[0] == ("goodput 66.7 %: 3.3 min productive of 5.0 min allocated (3 attempts, 2 "
                        "allocations); 5.0 min waiting between allocations (not allocated)"), lines
    assert lines[1] == ("lost: launch 13 s, start-up 36 s, checkpoints 12 s, evaluation 5.0 s, recompute "
                        "10 s, restarts 10 s, other 14 s"), lines
    assert "checkpoints: 6 saves (6 asynchronous), training blocked 0.50 s per save" in lines[3], lines


def test_an_allocation_without_slurms_start_begins_at_its_first_process():
    local = [{**r, "alloc_start": None} for r in RECORDS[:2]]
    g = account(local)
    assert g.lost["launch"] == 0 and g.allocated_s == pytest.approx(1200 - 1010)


def test_the_allocation_start_is_the_job_scripts_else_slurms():
    script, slurm = {"SLIPWAY_ALLOC_START": "1000"}, {"SLURM_JOB_START_TIME": "900"}
    assert clock.attempt_identity({**script, **slurm})["alloc_start"] == 1000.0
    assert clock.attempt_identity(slurm)["alloc_start"] == 900.0
    assert clock.attempt_identity({})["alloc_start"] is None and clock.attempt_identity({})["job"] == "local"


class _Time:
    """The clock module's time, moved by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now + 5000.0


@pytest.fixture
def fake_time(monkeypatch):
    t = _Time()
    monkeypatch.setattr(clock, "time", t)
    monkeypatch.setattr(clock, "process_start_time", lambda: t.time() - 3.0)  # 3 s of imports
    return t


def test_every_second_of_an_attempt_lands_in_one_span(tmp_path, fake_time):
    earlier = RunDir(tmp_path).goodput_record(1, "7", "0", "0")
    earlier.parent.mkdir(parents=True)
    earlier.write_text(json.dumps(RECORDS[0] | {"iteration": 12}))  # an earlier attempt reached 12
    c = AttemptClock(str(tmp_path), {"SLURM_JOB_ID": "7", "SLIPWAY_ATTEMPT": "1"})
    c.begin(0, 1)
    assert c.previous_iteration == 12
    for span, secs in (("rendezvous", 1.0), ("build", 2.0), ("checkpoint_load", 0.5)):
        c.switch(span)
        fake_time.now += secs
    c.training(10)
    fake_time.now += 4.0
    c.step(11)  # the first step: start-up, however long it took
    for it in (12, 13, 14):
        fake_time.now += 1.0
        c.step(it)  # 12: an earlier attempt ran it (recompute); 13, 14: new (productive)
    fake_time.now += 0.75  # step 15 runs its forward and backward ...
    left = c.switch("checkpoint")  # ... then waits for a save's host copy before its update ...
    fake_time.now += 0.25
    c.switch(left)
    fake_time.now += 0.25
    c.step(15)  # ... and ends: all of its own time is productive, the wait is the checkpoint's
    left = c.switch("evaluation")
    fake_time.now += 0.25
    c.switch(left)
    fake_time.now += 0.5  # a step in progress when the record is written
    rec = c.record()
    s = rec["seconds"]
    assert s == pytest.approx({"imports": 3.0, "setup": 0.0, "rendezvous": 1.0, "build": 2.0,
                               "checkpoint_load": 0.5, "first_step": 4.0, "recompute": 1.0,
                               "productive": 3.0, "checkpoint": 0.25, "evaluation": 0.25, "step": 0.5})
    assert sum(s.values()) == pytest.approx(rec["updated"] - rec["process_start"])
    assert rec["first_step_end"] == pytest.approx(5000 + 100 + 3.5 + 4.0)
    assert (rec["job"], rec["attempt"], rec["iteration"], rec["ended"]) == ("7", "1", 15, None)


def test_a_killed_attempts_last_record_counts_and_a_torn_one_is_skipped(tmp_path, fake_time):
    c = AttemptClock(str(tmp_path), {"SLURM_JOB_ID": "9"})
    c.begin(0, 1)
    c.training(0)
    fake_time.now += 2.0
    c.step(1)  # writes the record at once (time to first step)
    fake_time.now += 100.0  # ... then the process is killed: nothing more is written
    folder = RunDir(tmp_path).goodput
    (folder / "0000000000000_9_r0_a1.json").write_text('{"seconds": {"produ')  # a torn write, never ours
    [rec] = read_records(str(tmp_path))
    assert rec["iteration"] == 1 and rec["updated"] == pytest.approx(5000 + 102)
    assert not [n for n in os.listdir(folder) if ".tmp-" in n]  # written by rename


def test_status_and_the_summary_lines(tmp_path):
    run = tmp_path / "exp" / "r1"
    folder = RunDir(run).goodput
    folder.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"jobs": {}}))
    for i, r in enumerate(RECORDS):
        (folder / f"{i:013d}_7_r{r['restart']}_a{r['attempt']}.json").write_text(json.dumps(r))
    notes = goodput_notes(str(run))
    assert notes[0] == "" and notes[1].startswith("GOODPUT: run r1: goodput 66.7 %"), notes
    assert notes[2].startswith("  lost: launch") and len(notes) == 5, notes
    fresh = tmp_path / "exp" / "r2"  # a run with no attempt yet: no line
    fresh.mkdir()
    (fresh / "run.json").write_text(json.dumps({"jobs": {}}))
    assert goodput_notes(str(fresh)) == []
