"""orchestrator/readback/culprit.py: the rank that failed first, and why, from what the launcher saw (the
local controller's record, srun's lines) and the ranks' last heartbeats; its peers' communication errors,
hang-watchdog exits and teardown kills are consequences. The end-to-end cases (a rank killed, stopped, out
of memory on the local executor) are in test_local_promises.py."""

from __future__ import annotations

from orchestrator.readback.culprit import TaskEnd, first_failure, srun_ends
from trainer.health import judge

NOW = 1000.0
GLOO = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
        "[127.0.0.1]:29500")
OOM = "OutOfMemory: rank 2 ran out of memory at iteration 7 with layout tp=2 pp=2 dp=1 ..."


def beat(rank: int, phase: str, written: float, message: str = "", iteration: int = 7):
    return judge({"rank": rank, "host": f"n{rank // 2 + 1}", "pid": 100 + rank, "iteration": iteration,
                  "phase": phase, "interval_s": 1.0, "time": written, "progress_time": written,
                  "message": message}, NOW)


def test_srun_lines_of_the_last_attempt_say_which_task_ended_first_and_how():
    """srun's own words (Slurm's launch plugin: ``srun: error: <node>: task <n>: <strsignal or exit>``) of
    the last step attempt only; every task after the first line was ended by --kill-on-bad-exit. The lines
    as the devcluster's Slurm 22.05 wrote them (test_first_failure_slurm.py reads them back for real)."""
    log = "\n".join([
        "srun: error: n1: task 0: Exited with exit code 1",  # an earlier attempt: not this one's
        "slipway: train step attempt 0 (restart 0) exited with 1",
        "srun: error: n2: task 1: Killed",
        "srun: launch/slurm: _step_signal: Terminating StepId=56200014.1",
        "srun: error: n1: tasks 0,2-3: Terminated",
        "srun: Force Terminated StepId=56200014.1",
        "slipway: train step attempt 1 (restart 0) exited with 137",
    ])
    ends = srun_ends(log)
    assert [(e.rank, e.code, e.after_teardown, e.host) for e in ends] == [
        (1, -9, False, "n2"), (0, -15, True, "n1"), (2, -15, True, "n1"), (3, -15, True, "n1")]
    assert srun_ends("srun: error: n1: task 3: Exited with exit code 70\n")[0].code == 70  # still running


def test_a_rank_killed_by_a_signal_is_the_cause_and_its_peers_errors_follow():
    beats = [beat(0, "failed", 990, GLOO), beat(1, "failed", 991, GLOO), beat(2, "train", 980),
             beat(3, "failed", 990, GLOO)]
    ends = [TaskEnd(2, -9, 0, False), TaskEnd(0, 1, 1, True), TaskEnd(1, 1, 2, True), TaskEnd(3, 1, 3, True)]
    v = first_failure(beats, ends, [])
    assert v is not None and v.rank == 2
    assert v.cause == ("rank 2 (on n2, pid 102) was killed by SIGKILL at iteration 7, without an error of "
                       "its own")
    assert [c.split(" (")[0] for c in v.consequences] == ["rank 0", "rank 1", "rank 3"]
    assert all("Connection closed by peer" in c for c in v.consequences)


def test_without_the_launchers_word_a_rank_whose_heartbeat_never_ended_died_first():
    """Slurm with srun's lines lost (or a standalone run): the heartbeats alone. The rank that left no
    final heartbeat died without a Python error; the ranks with gloo errors only followed."""
    beats = [beat(0, "failed", 990, GLOO), beat(1, "failed", 989, GLOO), beat(2, "train", 995),
             beat(3, "exited", 990)]
    v = first_failure(beats, [], [])
    assert v is not None and v.rank == 2 and "without an error of its own (killed by a signal" in v.cause
    assert [c.split(" (")[0] for c in v.consequences] == ["rank 0", "rank 1"]


def test_an_error_of_its_own_beats_an_earlier_communication_error():
    """An out-of-memory rank's heartbeat may be written after a peer's gloo error (they end within one
    look of the launcher): a communication error is never the cause while a rank failed on its own."""
    beats = [beat(0, "failed", 990, GLOO), beat(2, "failed", 991, OOM), beat(1, "exited", 992)]
    v = first_failure(beats, [TaskEnd(0, 1, 0, False), TaskEnd(2, 1, 0, False)], [])
    assert v is not None and v.rank == 2 and v.cause.endswith(f"failed at iteration 7: {OOM}")
    assert len(v.consequences) == 1 and v.consequences[0].startswith("rank 0 (on n1, pid 100) failed")
    assert first_failure([beat(0, "exited", 990), beat(1, "exited", 990)], [], []) is None


def test_the_rank_the_first_watchdog_named_is_the_cause():
    """A stopped rank: the first watchdog that fired names it; a rank continued later may fire its own
    watchdog naming the ranks that had ended by then — not the cause."""
    beats = [beat(0, "hung", 990, "watchdog: ..."), beat(1, "hung", 991, "watchdog: ..."),
             beat(2, "hung", 999, "watchdog: ..."), beat(3, "failed", 995, GLOO)]
    def hang(time: float, reporter: int, iteration: int, stopped: int) -> dict:
        return {"time": time, "reporter": reporter, "iteration": iteration,
                "stopped": [f"rank {stopped} on n{stopped // 2 + 1} (pid {100 + stopped}; stale, ...)"]}

    hangs = [hang(10.0, 2, 6, 0),  # an earlier attempt's
             hang(990.0, 0, 7, 2), hang(999.0, 2, 7, 0), hang(991.0, 1, 7, 2)]
    v = first_failure(beats, [TaskEnd(0, 70, 0, False), TaskEnd(2, -9, 1, True)], hangs)
    assert v is not None and v.rank == 2
    assert v.cause == ("rank 2 (on n2, pid 102) stopped progressing at iteration 7; the hang watchdog of "
                       "rank 0 ended the step (exit 70), and the launcher then killed it (SIGKILL)")
    assert [c.split(" (")[0] for c in v.consequences] == ["rank 0", "rank 1", "rank 3"]
    assert "was ended by its hang watchdog at iteration 7 (exit 70)" in v.consequences[0]
