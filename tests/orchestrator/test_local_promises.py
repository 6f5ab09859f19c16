"""The embedded default (submitit's local executor) keeps Slurm's promises across a run's launches: a stage
waits for *this launch's* upstream job (never an older marker), a relaunch runs only what is missing and
refuses what would train nothing, the summary names the iteration the HF model holds, a divergence says
where, and a damaged run.json is one problem line (status still answers).

One run, launched seven times in a row on one small model (tp1, no eval, W&B off), as a user would."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.base.problems import PlanError
from orchestrator.launch.flow import EXIT_RUN_FAILED, RunFailed, launch
from orchestrator.readback.status import collect, format_rows
from orchestrator.record.launches import current_jobs
from tests.orchestrator.conftest import REPO, compose_cfg
from tests.orchestrator.devcluster_helpers import TINY_MODEL
from tests.seam import enabled, hook_env
from tests.waits import JOB_S, NEVER_S, wait_until
from trainer.run_files import FATAL_MARKER, RunDir

SMALL = [
    "+experiment=codeparrot_smoke",
    "data.corpus.max_files=12",
    "data.corpus.max_bytes=200000",
    "tokenizer.vocab_size=300",
    *TINY_MODEL,
    "parallel=tp1_pp1",
    "eval=none",
    "logging.wandb.mode=disabled",
    "train.eval_interval=1000",
    "train.save_interval=1000",  # one checkpoint, at the end: a stale conversion could only read the old one
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """The shared stages' outputs (corpus, tokenizer, preprocessed data), built once for the module."""
    return tmp_path_factory.mktemp("cache")


def _launch(root: Path, cache: Path, *extra: str, out: io.StringIO | None = None):
    cfg = compose_cfg([*SMALL, f"runs_root={root}/runs", f"cache_dir={cache}", "run_id=r", *extra])
    return launch(cfg, out=out or io.StringIO())


def _card_iteration(run: Path) -> int:
    """The iteration the converted model holds, as its model card records it (trainer/convert/card.py)."""
    m = re.search(r"^\| iteration \| (\d+) \|$", (run / "hf" / "README.md").read_text(), re.M)
    assert m, (run / "hf" / "README.md").read_text()[:2000]
    return int(m.group(1))


def _states(run: Path) -> dict[str, str]:
    return {r.stage: r.state for r in collect(str(run))}


@pytest.mark.timeout(900)
def test_relaunches_keep_afterok_and_do_only_what_is_missing(tmp_path, cache):
    run = tmp_path / "runs" / "codeparrot_smoke" / "r"
    out = io.StringIO()
    _launch(tmp_path, cache, "train.iters=3", out=out)
    assert re.search(r"HF model +\S+/hf \(iteration 3\)\n", out.getvalue()) and _card_iteration(run) == 3

    # More iterations: convert waits for this launch's training, not the first launch's _COMPLETE.
    out = io.StringIO()
    res = _launch(tmp_path, cache, "train.iters=6", out=out)
    assert {s.stage: s.action for s in res.submitted}["train"] == "submitted"
    assert _card_iteration(run) == 6, "the HF model was converted from an earlier launch's checkpoint"
    assert re.search(r"HF model +\S+/hf \(iteration 6\)\n", out.getvalue()), out.getvalue()

    # hf/ deleted: only conversion runs again (no train job that would load iteration 6 and stop).
    shutil.rmtree(run / "hf")
    jobs_before = current_jobs(json.loads((run / "run.json").read_text()))
    dry = io.StringIO()
    _launch(tmp_path, cache, "train.iters=6", "dry_run=true", out=dry)  # says so before submitting
    assert "no job: its checkpoint is at iteration 6 = train.iters: nothing to train" in dry.getvalue()
    assert dry.getvalue().count("no job:") == 3  # corpus, preprocess, train: convert would run
    res = _launch(tmp_path, cache, "train.iters=6")
    actions = {s.stage: s.action for s in res.submitted}
    assert actions == {"corpus": "reused", "preprocess": "reused", "train": "reused", "convert": "submitted"}
    assert set(current_jobs(json.loads((run / "run.json").read_text()))) == {"convert"}
    assert jobs_before["train"] and _card_iteration(run) == 6

    # Fewer iterations than the checkpoint holds: refused, saying so, instead of "completing".
    with pytest.raises(PlanError) as err:
        _launch(tmp_path, cache, "train.iters=4")
    assert [p.code for p in err.value.problems] == ["iters_below_checkpoint"]
    assert "at iteration 6, past train.iters=4" in str(err.value) and "train.iters=10" in str(err.value)

    # Training diverges: its failure names the iteration, and conversion never runs after it (afterok),
    # although the previous launch's convert and train markers said COMPLETE.
    with pytest.raises(RunFailed):
        _launch(tmp_path, cache, "train.iters=9", "optim.lr=1e12", "optim.min_lr=1e11",
                "optim.warmup_iters=0")
    states = _states(run)
    assert states == {"train": "FAILED", "convert": "FAILED"}, states
    table = format_rows(collect(str(run)))
    assert re.search(r"FAILED: run r stage train \(job \d+\): training diverged at iteration \d+: "
                     r"(loss|gradient norm) is not finite .* \(exit 65\)", table), table
    assert "upstream" in table and "afterok" in table  # convert's reason: it never ran
    assert _card_iteration(run) == 6  # the model of the last good launch stays

    # A damaged run.json: one problem line naming it and the way back, never a traceback; status answers.
    record = run / "run.json"
    record.write_text(record.read_text()[:100])
    with pytest.raises(PlanError) as err:
        _launch(tmp_path, cache, "train.iters=9")
    assert [p.code for p in err.value.problems] == ["run_record"]
    assert f"{record} is not a readable run record (not valid JSON" in str(err.value)
    assert f"{run / 'launches'}/<n>/" in str(err.value) and f"mv {record} {record}.broken" in str(err.value)
    status = subprocess.run([sys.executable, "-m", "orchestrator", "status", str(run)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr
    assert f"RUN RECORD: run r: {record} is not a readable run record" in status.stdout, status.stdout


def _alive(pid: int) -> bool:
    """A process exists and is not a zombie (the test's own reading of /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _stalled_run(over: list[str], run: Path, stall: int, env: dict,
                 err: Path) -> tuple[subprocess.Popen, set[int]]:
    """launch.py with every rank pausing after iteration ``stall``; once the four ranks have paused, the
    launcher and every process of the run (the launcher's descendants and each local job's own). Its
    output goes to ``err`` (a file: a pipe would stay open as long as a job that inherited it lives)."""
    with err.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "launch.py", *over], cwd=REPO, env=env, text=True,
                                start_new_session=True, stdout=sink, stderr=subprocess.STDOUT)
    stalled = run / "stages" / "train"
    wait_until(lambda: len(list(stalled.glob(f"stalled_{stall}_rank*"))) == 4 or proc.poll() not in (None, 0),
               f"the four training ranks to pause after iteration {stall}", JOB_S, poll_s=0.5)
    assert proc.poll() in (None, 0), err.read_text()[-3000:]
    jobs = {int(e["job_id"]) for entries in current_jobs(json.loads((run / "run.json").read_text())).values()
            for e in entries}
    pids = _descendants(proc.pid) | {j for j in jobs if _alive(j)}
    pids |= {d for j in jobs for d in _descendants(j)}
    ranks = {int(p.read_text().split()[0]) for p in RunDir(run).pids.glob("*.pid")}
    assert len(ranks) == 4 and ranks <= pids, (ranks, pids)
    return proc, pids


def _launch_and_stop(over: list[str], run: Path, stop: int | str, stall: int) -> None:
    """A run paused after iteration ``stall``, then stopped: ``stop`` a signal to the launcher's pid alone,
    or "cancel" (``python -m orchestrator cancel`` of a run whose launcher has returned, wait=false). Then
    every process of the run must be gone, its training and the conversion waiting for it CANCELLED (not
    FAILED "not running (afterok)"), no rank listed as failed, and each rank's log end with why it ended,
    not a traceback (issue 52, item 6)."""
    env = dict(os.environ, **hook_env(STALL_TRAIN=str(stall)))
    out = run.parent / f"launcher_{stall}.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    proc, pids = None, set()
    try:
        if stop == "cancel":
            proc, pids = _stalled_run([*over, "wait=false"], run, stall, env, out)
            assert proc.wait(timeout=NEVER_S) == 0, out.read_text()[-3000:]
            res = subprocess.run([sys.executable, "-m", "orchestrator", "cancel", str(run)], cwd=REPO,
                                 capture_output=True, text=True, timeout=NEVER_S)
            assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
            assert re.search(r"train job \d+ cancelled \(\d+ process\(es\) ended\)", res.stdout), res.stdout
        else:
            proc, pids = _stalled_run(over, run, stall, env, out)
            os.kill(proc.pid, stop)  # the launcher alone
            proc.wait(timeout=NEVER_S)
            err = out.read_text()
            assert proc.returncode == 128 + stop, (proc.returncode, err[-3000:])
            assert "Traceback" not in err, err[-3000:]
            assert re.search(r"interrupted: \d local job\(s\) of run r cancelled", err), err[-3000:]
        wait_until(lambda: not any(_alive(p) for p in pids), "every process of the run to end", NEVER_S)
        states = _states(run)
        assert (states["train"], states["convert"]) == ("CANCELLED", "CANCELLED"), states
        table = format_rows(collect(str(run)))
        assert "FAILED" not in table and "interrupted 4/4" in table, table
        entry = current_jobs(json.loads((run / "run.json").read_text()))["train"][-1]
        for rank in range(4):
            log = (Path(entry["folder"]) / f"{entry['job_id']}_{rank}_log.err").read_text()
            assert "Traceback" not in log and re.search(r"interrupted by SIGINT: the job was cancelled .*; "
                                                        r"launch the same run_id again to resume\n$", log), \
                log[-3000:]
    finally:
        _end_cleanly(proc, pids)


@pytest.mark.timeout(1200)
def test_a_signal_to_the_launcher_alone_cancels_every_process_and_the_run_resumes(tmp_path, cache):
    """SIGTERM, SIGINT, then SIGHUP, sent to launch.py's pid only (not its process group: a scheduler's
    kill, a parent that forwards Ctrl-C, a closed ssh session), and last ``python -m orchestrator cancel``
    of a run whose launcher returned: every process of the run ends — the job controllers, the four training
    ranks — the launcher says so and exits 128+signal, and each next launch resumes from the last checkpoint
    (saves every 2 iterations: paused after 3, 5, 7, 9, the launches resume from 2, 4, 6 and 8)."""
    run = tmp_path / "runs" / "codeparrot_smoke" / "r"
    extra = ["parallel=tp2_pp2", "train.iters=10", "train.save_interval=2"]
    over = [*SMALL, f"runs_root={tmp_path}/runs", f"cache_dir={cache}", "run_id=r", *extra]
    # Ctrl-C with W&B on (offline): its service, a process of the job too, gets the cancel's SIGINT; its
    # atexit hook's ConnectionResetError traceback used to end rank 0's log instead of the cause.
    wandb = ["logging.wandb.mode=offline"]
    for stall, stop, more in ((3, signal.SIGTERM, []), (5, signal.SIGINT, wandb), (7, signal.SIGHUP, []),
                              (9, "cancel", [])):
        _launch_and_stop([*over, *more], run, stop, stall)

    res = _launch(tmp_path, cache, *extra)
    train = next(s for s in res.submitted if s.stage == "train")
    log = (run / "jobs" / "train" / f"{train.job_id}_0_log.err").read_text()
    assert re.search(r"loaded \w+ from \S+ iteration 8 ", log), log[-3000:]
    assert set(_states(run).values()) == {"COMPLETED"} and _card_iteration(run) == 10


def test_a_pid_the_system_reused_is_not_the_runs_job(tmp_path):
    """A local job id is a pid, and pids wrap (pid_max is 32768 here): after the job ended, another program
    may hold its number. That program must not make the run look active (a relaunch refused forever), nor
    its stage RUNNING, nor be cancelled."""
    other = subprocess.Popen(["sleep", "600"])
    try:
        run = tmp_path / "runs" / "codeparrot_smoke" / "r"
        folder = run / "jobs" / "train"
        folder.mkdir(parents=True)
        entry = {"job_id": str(other.pid), "executor": "local", "folder": str(folder),
                 "state_dir": str(run / "stages" / "train")}
        (run / "run.json").write_text(json.dumps({"run_id": "r", "format": 2, "launches": [
            {"n": 1, "state": "submitted", "jobs": {"train": [entry]}}]}))
        assert _states(run) == {"train": "ENDED"}
        cfg = compose_cfg([*SMALL, f"runs_root={tmp_path}/runs", f"cache_dir={tmp_path}/c", "run_id=r",
                           "dry_run=true"])
        assert "run_active" not in [p.code for p in launch(cfg, out=io.StringIO()).plan.problems]
        from orchestrator.__main__ import main as orchestrator_main

        assert orchestrator_main(["cancel", str(run)]) == 0
        assert other.poll() is None  # untouched
    finally:
        other.kill()
        other.wait()


HANG_S = 20  # the watchdog's timeout in the stopped-rank test: far above the test's reaction to the pause
FOUR_RANKS = ["parallel=tp2_pp2", "train.iters=10", "train.save_interval=2", "train.heartbeat_interval_s=0.5"]


def _logs(run: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m orchestrator logs RUN`` as a user runs it."""
    res = subprocess.run([sys.executable, "-m", "orchestrator", "logs", str(run), *args], cwd=REPO,
                         capture_output=True, text=True, timeout=NEVER_S)
    assert res.returncode == 0, res.stderr
    return res


def _rank_pid(run: Path, rank: int) -> int:
    return int(RunDir(run).rank_pid(rank).read_text().split()[0])


def _end_cleanly(proc: subprocess.Popen | None, pids: set[int]) -> None:
    """On a failure, leave nothing running (a stopped process needs SIGKILL)."""
    for p in pids:
        if _alive(p):
            os.kill(p, signal.SIGKILL)
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(900)
def test_a_stopped_rank_ends_its_attempt_and_the_run_on_the_local_executor(tmp_path, cache):
    """``kill -STOP`` of rank 2 while every rank is paused (issue 50, item 4): the others' hang watchdogs
    end them naming rank 2; the local controller then ends the stopped rank too (SIGCONT, SIGTERM, SIGKILL
    after its kill wait) and reaps it, so the train job FAILS instead of staying RUNNING, the convert job
    waiting for it — PENDING (Dependency) until then, never RUNNING — ends at once (no zombie counts as
    its upstream alive), the launcher returns and no process of the run is left."""
    run = tmp_path / "runs" / "codeparrot_smoke" / "r"
    over = [*SMALL, f"runs_root={tmp_path}/runs", f"cache_dir={cache}", "run_id=r", *FOUR_RANKS,
            f"train.hang_timeout_s={HANG_S}"]
    out = run.parent / "launcher.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    proc, pids = None, set()
    try:
        proc, pids = _stalled_run(over, run, 3, dict(os.environ, **hook_env(STALL_TRAIN="3")), out)
        stopped = _rank_pid(run, 2)
        os.kill(stopped, signal.SIGSTOP)
        assert proc.wait(timeout=HANG_S + NEVER_S) == EXIT_RUN_FAILED, out.read_text()[-3000:]
        wait_until(lambda: not any(_alive(p) for p in pids), "every process of the run to end", NEVER_S)
        assert {s: st for s, st in _states(run).items() if s in ("train", "convert")} == \
            {"train": "FAILED", "convert": "FAILED"}
        table = format_rows(collect(str(run)))
        assert re.search(rf"FAILED: run r stage train \(job \d+\): rank 2 \(on \S+, pid {stopped}\) stopped "
                         r"progressing at iteration 3; the hang watchdog of rank [013] ended the step "
                         r"\(exit 70\)\n", table), table
        assert len(re.findall(r"\n  after it: rank [013] ", table)) == 3, table
        # convert never ran: its upstream failed (rank 0 raised: _FAILED) or ended without completing (rank
        # 0's watchdog ended it: no marker), whichever rank 0 met first
        assert re.search(r"FAILED: run r stage convert \(job \d+\): not run: upstream .* \(afterok\)$", table,
                         re.M), table
        launcher = out.read_text()
        assert re.search(r"convert job \d+: PENDING \(Dependency\)\n", launcher), launcher[-3000:]
        assert not re.search(r"convert job \d+: RUNNING", launcher), launcher[-3000:]
    finally:
        _end_cleanly(proc, pids)


@pytest.mark.timeout(900)
def test_the_rank_killed_first_is_the_reason_not_its_peers_errors(tmp_path, cache):
    """``kill -9`` of rank 2 while every rank is paused (issue 50, item 5): it dies without a Python error
    of its own, its peers then fail with gloo's "Connection closed by peer". The reason is rank 2, killed by
    SIGKILL; ranks 0, 1 and 3 are listed after it, never as the failure."""
    run = tmp_path / "runs" / "codeparrot_smoke" / "r"
    over = [*SMALL, f"runs_root={tmp_path}/runs", f"cache_dir={cache}", "run_id=r", *FOUR_RANKS,
            "convert.enabled=false"]
    out = run.parent / "launcher.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    proc, pids = None, set()
    try:
        proc, pids = _stalled_run(over, run, 3, dict(os.environ, **hook_env(STALL_TRAIN="3")), out)
        killed = _rank_pid(run, 2)
        os.kill(killed, signal.SIGKILL)
        assert proc.wait(timeout=NEVER_S) == EXIT_RUN_FAILED, out.read_text()[-3000:]
        table = format_rows(collect(str(run)))
        assert re.search(rf"FAILED: run r stage train \(job \d+\): rank 2 \(on \S+, pid {killed}\) was "
                         r"killed by SIGKILL at iteration \d, without an error of its own\n", table), table
        after = re.findall(r"\n  after it: rank ([013]) .*", table)
        assert sorted(after) == ["0", "1", "3"], table
        assert "FAILED: run r rank" not in table  # the peers' errors are consequences, not failures
        logs = _logs(run, "-n", "3")  # by default the log of the rank that failed first, not rank 0's
        assert "task 2, stderr" in logs.stderr, logs.stderr
        assert f"task 2 (pid {killed}) was killed by SIGKILL" in logs.stdout, logs.stdout
    finally:
        _end_cleanly(proc, pids)


@pytest.mark.timeout(900)
def test_a_rank_out_of_memory_is_the_reason_with_its_layout_and_fix(tmp_path, cache):
    """Rank 2 runs out of memory after iteration 2 (the real CPU allocator refuses, through the fault
    seam): the reason is its allocator's words with the layout and the fixes, and a retry would repeat it
    (exit 78: the sbatch script's fatal marker); its peers' gloo errors are listed after it."""
    run = tmp_path / "runs" / "codeparrot_smoke" / "r"
    with enabled(FAIL_TRAIN="oom@2:2"), pytest.raises(RunFailed):
        _launch(tmp_path, cache, *FOUR_RANKS, "convert.enabled=false")
    table = format_rows(collect(str(run)))
    m = re.search(r"FAILED: run r stage train \(job (\d+)\): OutOfMemory: rank 2 ran out of memory at "
                  r"iteration 2 with layout tp=2 pp=2 dp=1, micro-batch 2, sequence 64, recompute none, "
                  r"fp32: DefaultCPUAllocator: can't allocate memory: .*; use a smaller "
                  r"train.micro_batch_size \(now 2\), or activation recomputation "
                  r"\(train.recompute_granularity=full\), or more pipeline stages \(parallel.pp_size "
                  r"above 2\) \(exit 78\)\n", table)
    assert m, table
    assert sorted(re.findall(r"\n  after it: rank ([013]) ", table)) == ["0", "1", "3"], table
    fatal = list((run / "stages" / "train").glob(FATAL_MARKER.format(job=m[1], restart="*", attempt="*")))
    assert len(fatal) == 1 and fatal[0].read_text().startswith("78 OutOfMemory: rank 2 ran out of memory")
    logs = _logs(run)
    assert "task 2, stderr" in logs.stderr and "OutOfMemory: rank 2 ran out of memory" in logs.stdout
