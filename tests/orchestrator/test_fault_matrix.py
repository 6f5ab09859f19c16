"""The fault matrix on the devcluster: real Slurm, real processes, real signals, a real full disk.

One module fixture builds a tiny dataset (12 stdlib files as JSONL with two bad lines, a 300-entry BPE),
then submits every run at once; they share one preprocessing job (content key) and run side by side on
the two nodes (tp=2 across n1 and n2, one task each: four such runs fit at a time). Faults are timed with the
``SLIPWAY_STALL_TRAIN`` hook (every rank pauses after iteration N until a signal arrives), so nothing races a
fast run: a driver thread preempts or kills the stalled runs, Slurm's own time-limit signal wakes the
time-limited one. The tests then only wait and compare.

Every faulted run must end with the same per-iteration losses as the uninterrupted ``base`` run
(``train.deterministic``), or in the exact state the case describes.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from orchestrator.base.problems import PlanError
from orchestrator.launch.flow import launch
from orchestrator.readback.status import collect, format_rows
from orchestrator.record.launches import current
from tests.orchestrator.conftest import REPO, compose_cfg
from tests.orchestrator.devcluster_helpers import (
    TINY_MODEL,
    cancel_runs,
    job_ids,
    log_text,
    losses,
    newest_job_id,
    states,
    wait_for,
    wait_states,
)
from tests.seam import hook_env
from tests.slurm_cli import sacct_states, slurm
from trainer.run_files import RunDir

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]

ITERS = 12
BAD_LINES = {3: "{not json", 7: json.dumps({"text": "no content key"})}  # 1-based line numbers
# Two shards of the tiny model at tp=2 (weights, Adam moments, RNG, args) take 2.95 MiB together, and
# the pre-save check asks for ~3.4 MiB (its estimate errs high): a 5 MiB tmpfs takes the first
# checkpoint (and the launch's small files) but not a second one (checkpoint.keep=1 prunes only after).
DISKFULL_TMPFS = "5m"

COMMON = [
    "+experiment=codeparrot_smoke",
    "cluster=devcluster",
    *TINY_MODEL,
    "data.corpus=null",
    "data.on_error=skip",
    "parallel.tp_size=2",
    "parallel.pp_size=1",
    "cluster.tasks_per_node=1",
    f"train.iters={ITERS}",
    "train.save_interval=4",
    "train.eval_interval=100",
    "train.deterministic=true",
    "convert.enabled=false",
    "logging.wandb.mode=disabled",
    # PyTorch's own kernels: the loss comparisons do not depend on how the C++ extension was built.
    "kernels=eager",
    "wait=false",
]  # the runs use test-only hooks (the stall, the checkpoint failpoint): the fixture turns the switch on

# name → extra overrides; submitted in this order (Slurm starts equal-priority jobs by id): the failing
# preprocessing job first (it must not queue behind four training jobs that fill both nodes), then the
# longest chain. Time limit: Slurm sends --signal=USR2@30 at its first 30-s check after end - 60 s, so a
# 2-min limit gives 60-90 s before the signal (past the stall at iteration 6) and >= 30 s to save after it.
RUNS = {
    "badfail": ["data.on_error=fail"],
    "timelimit": ["+cluster.env.SLIPWAY_STALL_TRAIN=6", "cluster.time_limit_min=2",
                  "cluster.signal_delay_s=30", "cluster.max_timeouts=3"],
    "base": [],
    "usr2": ["+cluster.env.SLIPWAY_STALL_TRAIN=5"],
    "killrank": ["+cluster.env.SLIPWAY_STALL_TRAIN=6"],
    "killsave": ["+cluster.env.SLIPWAY_CKPT_FAILPOINT=mid_write@8",
                 "+cluster.env.SLIPWAY_CKPT_FAILPOINT_ONCE={root}/killsave.once"],
    "diskfull": ["checkpoint.keep=1"],  # max_retries stays 2: a full disk must not be retried
    # W&B online on nodes that cannot reach it (WANDB_BASE_URL: a local port nothing listens on).
    "wandboff": ["logging.wandb.mode=online", "+cluster.env.WANDB_BASE_URL={wandb_url}"],
    "wandbreq": ["logging.wandb.mode=online", "logging.wandb.require_online=true",
                 "+cluster.env.WANDB_BASE_URL={wandb_url}"],
}
FAKE_WANDB_KEY = "slipway-fault-matrix-" + "0" * 40  # never checked: the server is unreachable


@dataclass
class Matrix:
    root: Path
    overrides: dict[str, list[str]]
    runs: dict[str, Path]
    fired: dict[str, str] = field(default_factory=dict)  # driver actions taken: name → what
    stop: threading.Event = field(default_factory=threading.Event)

    def train_state_dir(self, name: str) -> Path:
        return self.runs[name] / "stages" / "train"


def _dataset(root: Path) -> tuple[Path, Path, Path]:
    """corpus.jsonl with BAD_LINES inserted, and a BPE trained on the clean corpus."""
    from trainer.config import CorpusConfig
    from trainer.data.corpus import build_corpus
    from trainer.data.train_tokenizer import TokenizerTrainConfig, train_tokenizer

    clean = root / "clean.jsonl"
    build_corpus(CorpusConfig(max_files=12, max_bytes=200_000, exclude_tests=True), str(clean))
    vocab, merges = train_tokenizer(TokenizerTrainConfig(inputs=[str(clean)], output_dir=str(root / "tok"),
                                                         vocab_size=300))
    lines = clean.read_text().splitlines()
    for n in sorted(BAD_LINES):
        lines.insert(n - 1, BAD_LINES[n])
    data = root / "bad.jsonl"
    data.write_text("\n".join(lines) + "\n")
    return data, Path(vocab), Path(merges)


def _mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir(parents=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, f"mounting a tmpfs needs root: {res.stderr}"


def _drive(m: Matrix) -> None:
    """Act on stalled runs: preempt ``usr2`` (USR2 to the batch shell), SIGKILL ``killrank``'s rank 1."""
    while not m.stop.wait(0.5):
        try:
            if "usr2" not in m.fired and (m.train_state_dir("usr2") / "stalled_5_rank0").exists():
                job = job_ids(m.runs["usr2"])["train"]
                subprocess.run(["scancel", "--signal=USR2", "--batch", job], check=True, timeout=60)
                m.fired["usr2"] = f"USR2 to job {job}"
            if "killrank" not in m.fired and (m.train_state_dir("killrank") / "stalled_6_rank1").exists():
                pid = int(RunDir(m.runs["killrank"]).rank_pid(1).read_text().split()[0])
                os.kill(pid, signal.SIGKILL)  # the task on n2, started by this module's job
                m.fired["killrank"] = f"SIGKILL to rank 1 (pid {pid})"
        except Exception as err:  # noqa: BLE001 - reported by the test that needed the action
            m.fired.setdefault("error", repr(err))


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    data, vocab, merges = _dataset(root)
    base = [*COMMON, f"data.paths=[{data}]", f"tokenizer.vocab_file={vocab}",
            f"tokenizer.merge_file={merges}", f"runs_root={root}/runs", f"cache_dir={root}/cache"]
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        wandb_url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    overrides = {name: [*base, f"run_id={name}", *(o.format(root=root, wandb_url=wandb_url) for o in extra)]
                 for name, extra in RUNS.items()}
    runs = {name: root / "runs" / "codeparrot_smoke" / name for name in RUNS}
    _mount_tmpfs(runs["diskfull"] / "checkpoints", DISKFULL_TMPFS)
    m = Matrix(root, overrides, runs)
    driver = threading.Thread(target=_drive, args=(m,), daemon=True)
    key = os.environ.get("WANDB_API_KEY")
    os.environ["WANDB_API_KEY"] = FAKE_WANDB_KEY  # jobs get the launch's environment, as from a user's shell
    os.environ.update(hook_env())  # the hooks are allowed for this module's launches and jobs
    try:
        for name in RUNS:
            launch(compose_cfg(overrides[name]), out=io.StringIO())
        driver.start()
        yield m
    finally:
        os.environ.pop("WANDB_API_KEY") if key is None else os.environ.update(WANDB_API_KEY=key)
        for name in hook_env():
            os.environ.pop(name, None)
        m.stop.set()
        cancel_runs(list(runs.values()))
        subprocess.run(["umount", "-l", str(runs["diskfull"] / "checkpoints")], timeout=30, check=False)


@pytest.fixture(scope="module")
def base_losses(matrix) -> dict[int, float]:
    run = matrix.runs["base"]
    assert wait_states(run)["train"] == "COMPLETED"
    out = losses(run)
    assert sorted(out) == list(range(1, ITERS + 1))
    return out


def _assert_same_losses(run: Path, base: dict[int, float]) -> None:
    got = losses(run)
    assert sorted(got) == sorted(base)
    assert got == pytest.approx(base, rel=0, abs=0)
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


# ------------------------------------------------------------------------------------ refused before a job


def test_8_double_launch_is_refused_while_the_run_is_active(matrix):
    """A second launch.py of a queued/running run (same run id), or of another run writing the same
    checkpoint directory, is refused: no job reaches the queue and run.json is untouched."""
    run = matrix.runs["base"]
    first = job_ids(run)["train"]
    assert states(run)["train"] in ("PENDING", "RUNNING")
    before, newest = (run / "run.json").read_text(), newest_job_id()
    # Suspend the running job while both second launches plan (their imports take seconds on a busy box):
    # otherwise the run may finish first and a relaunch is, correctly, no double launch at all.
    # A pending job cannot be suspended and stays pending; both states count as active.
    suspended = states(run)["train"] == "RUNNING"
    if suspended:
        slurm("scontrol", "suspend", str(first))
    other = [*matrix.overrides["base"], "run_id=other", f"checkpoint.dir={run / 'checkpoints'}"]
    try:
        assert states(run)["train"] in ("PENDING", "RUNNING", "SUSPENDED")
        res = subprocess.run([sys.executable, "launch.py", *matrix.overrides["base"]], cwd=REPO,
                             capture_output=True, text=True, timeout=300, env=os.environ)
        with pytest.raises(PlanError) as err:
            launch(compose_cfg(other), out=io.StringIO())
    finally:
        if suspended:
            slurm("scontrol", "resume", str(first))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "[run_active]" in res.stderr and f"train job {first}" in res.stderr, res.stderr
    assert f"python -m orchestrator status {run}" in res.stderr
    assert f"train job {first} of run {run}" in str(err.value) and str(run / "checkpoints") in str(err.value)
    assert newest_job_id() == newest  # nothing was submitted
    assert (run / "run.json").read_text() == before
    assert not (run.parent / "other").exists()


def test_6_corrupt_cached_data_is_refused_at_plan_time(matrix):
    """The run's preprocessed data, reused from a cache where its .bin was truncated (then its .idx
    mangled), is refused by the plan naming the file and the problem; nothing is submitted."""
    meta = json.loads((matrix.runs["base"] / "run.json").read_text())
    prep = Path(current(meta)["stages"]["preprocess"]["dir"])
    wait_for(lambda: (prep / "_COMPLETE").exists(), what="the shared preprocessing job")
    broken = matrix.root / "cache2" / "preprocess" / prep.name  # same key, another cache
    broken.mkdir(parents=True)
    for name in ("_COMPLETE", "data_content_document.bin", "data_content_document.idx"):
        shutil.copy(prep / name, broken / name)  # (not its index-cache/: running jobs write there)
    cfg = [*matrix.overrides["base"], "run_id=corrupt", f"cache_dir={matrix.root / 'cache2'}"]
    binp, idx = broken / "data_content_document.bin", broken / "data_content_document.idx"
    newest = newest_job_id()
    with open(binp, "r+b") as f:
        f.truncate(binp.stat().st_size - 10)
    with pytest.raises(PlanError) as err:
        launch(compose_cfg(cfg), out=io.StringIO())
    msg = str(err.value)
    assert "[data_corrupt]" in msg and f"{binp}: {binp.stat().st_size} bytes, but {idx} describes" in msg, msg
    assert f"rm -r {broken}" in msg
    shutil.copy(prep / binp.name, binp)
    idx.write_bytes(b"NOTANIDX!" + idx.read_bytes()[9:])
    with pytest.raises(PlanError) as err:
        launch(compose_cfg(cfg), out=io.StringIO())
    assert f"{idx}: bad magic" in str(err.value), str(err.value)
    assert newest_job_id() == newest
    assert not (matrix.runs["base"].parent / "corrupt").exists()


def test_7_bad_jsonl_lines_fail_the_preprocess_job_and_training_never_starts(matrix):
    run = matrix.runs["badfail"]
    final = wait_states(run)
    assert final["preprocess"] == "FAILED" and final["train"] in ("CANCELLED", "PENDING"), final
    prep = Path(current(json.loads((run / "run.json").read_text()))["stages"]["preprocess"]["dir"])
    error = json.loads((prep / "_FAILED").read_text())["error"]
    assert f"{matrix.root / 'bad.jsonl'}:3: invalid JSON" in error, error
    assert "rerun with data.on_error=skip" in error and "--on-error" not in error, error  # launch.py's words
    assert f"{matrix.root / 'bad.jsonl'}:3: invalid JSON" in "".join(
        p.read_text() for p in (prep / "logs").glob("preprocess_*.err"))
    assert not list((run / "logs").glob("train_*")) and not RunDir(run).pids.exists()  # never ran


def test_7_bad_jsonl_lines_skipped_run_completes_with_the_report(matrix, base_losses):
    """The base run itself trains on the corpus with two bad lines (data.on_error=skip)."""
    report = json.loads((matrix.runs["base"] / "data_report.json").read_text())
    assert report["skipped_lines"] == 2
    assert report["skipped"] == {"invalid_json": 1, "missing_key": 1}
    where = sorted((Path(e["file"]).name, e["line"]) for e in report["skipped_examples"])
    assert where == [("bad.jsonl", 3), ("bad.jsonl", 7)]


# -------------------------------------------------------------------------- faults during training


def test_1_usr2_preemption_requeues_and_resumes_with_identical_losses(matrix, base_losses):
    run = matrix.runs["usr2"]
    assert wait_states(run)["train"] == "COMPLETED", matrix.fired
    assert matrix.fired.get("usr2", "").startswith("USR2"), matrix.fired
    state = matrix.train_state_dir("usr2")
    assert len(_lines(state / "requeues")) == 1 and not (state / "timeouts").exists()
    assert list((run / "logs").glob("train_*_r1_a0_0.err"))  # the restart shows in the log names
    resumed = log_text(run, "train_*_r1_a0_0.err")
    assert f"loaded checkpoint from {run / 'checkpoints'} iteration 5 " in resumed, resumed[-3000:]
    _assert_same_losses(run, base_losses)


def test_3_killed_rank_fails_the_step_and_the_retry_resumes_from_the_last_checkpoint(matrix, base_losses):
    run = matrix.runs["killrank"]
    assert wait_states(run)["train"] == "COMPLETED", matrix.fired
    assert matrix.fired.get("killrank", "").startswith("SIGKILL"), matrix.fired
    assert len(_lines(matrix.train_state_dir("killrank") / "retries")) == 1
    retry = log_text(run, "train_*_r0_a1_0.err")
    assert f"loaded checkpoint from {run / 'checkpoints'} iteration 4 " in retry, retry[-3000:]
    _assert_same_losses(run, base_losses)


def test_4_kill_inside_a_checkpoint_save_keeps_the_previous_one_latest(matrix, base_losses):
    run = matrix.runs["killsave"]
    assert wait_states(run)["train"] == "COMPLETED"
    assert (matrix.root / "killsave.once").exists()  # a writer SIGKILLed itself mid-write of iteration 8
    assert len(_lines(matrix.train_state_dir("killsave") / "retries")) == 1
    retry = log_text(run, "train_*_r0_a1_0.err")
    # Iteration 4 stayed the latest and loads:
    assert f"loaded checkpoint from {run / 'checkpoints'} iteration 4 " in retry, retry[-3000:]
    _assert_same_losses(run, base_losses)
    ckpts = run / "checkpoints"
    assert not [p for p in ckpts.rglob("*") if p.name.startswith((".tmp-", ".trash-"))]


def test_5_disk_full_fails_clearly_keeps_the_previous_checkpoint_and_a_relaunch_finishes(
        matrix, base_losses):
    run, ckpts = matrix.runs["diskfull"], matrix.runs["diskfull"] / "checkpoints"
    assert wait_states(run)["train"] == "FAILED"
    failed = json.loads((run / "stages" / "train" / "_FAILED").read_text())["error"]
    logged = log_text(run, "train_*_r0_a0_*.err")
    for text in (failed, logged):
        assert f"not enough space in {ckpts} for the checkpoint of iteration 8: it needs ~" in text, text
        assert "the latest checkpoint (iteration 4) is unchanged" in text
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text() == "4"
    assert not (matrix.train_state_dir("diskfull") / "retries").exists()  # a retry would fill it again
    assert "slipway: not retrying (a retry would repeat it): CheckpointSpaceError: not enough space" in \
        log_text(run, "train_*_batch.out")
    assert sorted(p.name for p in ckpts.iterdir() if not p.name.startswith(".slipway")) == [
        "iter_0000004", "latest_checkpointed_iteration.txt"]
    assert not [p for p in ckpts.rglob("*") if p.name.startswith((".tmp-", ".trash-"))]
    # Room again: the same launch resumes from iteration 4 and ends where the uninterrupted run did.
    subprocess.run(["mount", "-o", "remount,size=64m", str(ckpts)], check=True, timeout=30)
    launch(compose_cfg(matrix.overrides["diskfull"]), out=io.StringIO())
    assert wait_states(run)["train"] == "COMPLETED"
    assert f"loaded checkpoint from {ckpts} iteration 4 " in log_text(run, "train_*_r0_a0_0.err")
    _assert_same_losses(run, base_losses)


def test_2_time_limit_checkpoints_requeues_and_finishes_within_max_timeouts(matrix, base_losses):
    run = matrix.runs["timelimit"]
    assert wait_states(run)["train"] == "COMPLETED"
    state = matrix.train_state_dir("timelimit")
    timeouts = int((state / "timeouts").read_text())
    assert 1 <= timeouts <= 3  # cluster.max_timeouts
    assert len(_lines(state / "requeues")) == timeouts
    job = job_ids(run)["train"]
    sacct = sacct_states(job, duplicates=True)
    assert sacct[0] == "REQUEUED" and sacct[-1] == "COMPLETED" and "TIMEOUT" not in sacct, sacct
    # Slurm's --signal=USR2@30, before the limit, reaches every task; the rank whose handler sees it first
    # logs the signal, the others "signal on another rank" (the stop is agreed by a collective): any rank.
    stops = log_text(run, "train_*_r*_a*_*.err")
    assert "stop requested (SIGUSR2)" in stops, stops[-3000:]
    _assert_same_losses(run, base_losses)


def test_9_wandb_unreachable_trains_offline_with_one_warning_and_the_sync_command(matrix, base_losses):
    run = matrix.runs["wandboff"]
    assert wait_states(run)["train"] == "COMPLETED"
    assert not (matrix.train_state_dir("wandboff") / "retries").exists()
    _assert_same_losses(run, base_losses)
    logged = log_text(run, "train_*_r0_a0_0.err")
    assert logged.count("W&B is unreachable from this node") == 1, logged[-3000:]
    assert "Traceback" not in logged and "ConnectionResetError" not in logged, logged[-3000:]
    offline = [p for p in (run / "wandb").glob("offline-run-*") if p.is_dir()]
    assert len(offline) == 1 and list(offline[0].glob("run-*.wandb")), offline
    status = format_rows(collect(str(run)))
    assert "W&B: run wandboff: W&B is unreachable from this node (http://127.0.0.1:" in status, status
    assert f"upload with: wandb sync {offline[0]}" in status, status


def test_9_wandb_required_online_fails_once_and_is_not_retried(matrix):
    run = matrix.runs["wandbreq"]
    assert wait_states(run)["train"] == "FAILED"
    assert not (matrix.train_state_dir("wandbreq") / "retries").exists()  # a retry would not bring W&B
    assert "slipway: not retrying (a retry would repeat it): WandbError: W&B is unreachable" in \
        log_text(run, "train_*_batch.out")
    status = format_rows(collect(str(run)))
    assert "FAILED: run wandbreq stage train (job" in status and "require_online=true" in status, status
    assert not (run / "checkpoints" / "latest_checkpointed_iteration.txt").exists()
