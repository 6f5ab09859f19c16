"""THE hang test: two real ``python -m trainer.run`` ranks (gloo over TCP, as torchrun would start them);
rank 1 is SIGSTOPped mid-training. Rank 0 blocks in a collective that never returns; its watchdog ends it
with exit code 70 and a line naming the stopped rank and its host (from the heartbeats), the last iteration
and the idle time; ``python -m orchestrator status`` marks the stopped rank stale, naming its host, and
after the retry still shows the hang (``hangs.jsonl``)."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.readback.status import collect, format_rows
from orchestrator.world.runs import write_json
from tests.train.harness import tiny_config, write_dataset
from tests.waits import NEVER_S, wait_until
from trainer.signals import EXIT_HANG

HANG_TIMEOUT_S = 10.0  # a loaded machine may take seconds over a step or a save: never a false hang
REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _last_iteration(metrics) -> int:
    if not os.path.exists(metrics):
        return 0
    rows = [json.loads(line) for line in open(metrics) if line.strip()]
    return max((r["iteration"] for r in rows if "train/lm_loss" in r), default=0)


def _status(run_dir) -> str:
    out = subprocess.run([sys.executable, "-m", "orchestrator", "status", str(run_dir), "--stale-after", "2"],
                         capture_output=True, text=True, timeout=120, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    return out.stdout


def _launch(cfg_file, port: int, *overrides: str) -> list[subprocess.Popen]:
    """Two ranks of ``python -m trainer.run``, on emulated nodes nodeA and nodeB."""
    procs = []
    for rank, node in enumerate(("nodeA", "nodeB")):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "SLIPWAY_NODE_NAME": node, "PYTHONPATH": str(REPO)}  # this checkout's trainer
        cmd = [sys.executable, "-m", "trainer.run", "--config", str(cfg_file), *overrides]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True, cwd=REPO))
    return procs


@pytest.mark.slow  # ~30 s: a real run, a rank stopped, the hang timeout waited out, the retry
def test_sigstopped_rank_ends_the_run(tmp_path):
    data = write_dataset(str(tmp_path / "data"))
    run_dir = tmp_path / "run"
    d = tiny_config(str(run_dir), data, train={"iters": 100000, "log_interval": 1, "save_interval": 5,
                                               "eval_interval": 7, "heartbeat_interval_s": 0.25,
                                               "hang_timeout_s": HANG_TIMEOUT_S, "preflight_timeout_s": 30})
    cfg_file = tmp_path / "resolved.yaml"
    cfg_file.write_text(yaml.safe_dump(d))
    procs = _launch(cfg_file, _free_port())
    rank0, rank1 = procs
    # run.json as the orchestrator writes it, so status finds the run (its job: rank 0's process).
    write_json(run_dir / "run.json", {"run_id": "hang", "jobs": {"train": [
        {"job_id": str(rank0.pid), "executor": "local", "folder": str(tmp_path / "jobs"),
         "state_dir": str(run_dir / "stages" / "train")}]}})
    try:
        beat1 = run_dir / "heartbeats" / "rank_00001.json"

        def running() -> bool:  # past two saves and an evaluation, and rank 1's heartbeat tells an iteration
            assert rank0.poll() is None, rank0.communicate()[1][-3000:]
            return _last_iteration(run_dir / "train_metrics.jsonl") >= 12 and \
                json.loads(beat1.read_text() if beat1.exists() else "{}").get("iteration") is not None

        wait_until(running, "iteration 12 on both ranks")
        # Healthy: neither rank is stalled or stale (judged with the generous bound: a loaded machine may
        # delay a heartbeat write by seconds, which is not what this line is about).
        [row] = collect(str(run_dir), stale_after_s=NEVER_S)
        assert row.health == "ok 2/2", format_rows([row])
        rank1.send_signal(signal.SIGSTOP)
        err = rank0.communicate(timeout=HANG_TIMEOUT_S + NEVER_S)[1]
        assert rank0.returncode == EXIT_HANG, err[-3000:]
        line = next(ln for ln in err.splitlines() if "watchdog: no training progress" in ln)
        m = re.search(r"no training progress for (\d+\.\d) s \(train.hang_timeout_s=10\) at iteration (\d+), "
                      r"phase (train|eval|save); stopped progressing: rank 1 on nodeB \(pid (\d+); stale, "
                      r"heartbeat [0-9.]+ s old, iteration \d+, phase \w+\)\. This rank, rank 0 of 2 "
                      r"\(host nodeA, pid \d+\), was waiting", line)
        assert m and float(m.group(1)) >= HANG_TIMEOUT_S and int(m.group(4)) == rank1.pid, line
        hung_at = int(m.group(2))
        assert hung_at >= _last_iteration(run_dir / "train_metrics.jsonl") >= 12
        assert "exit code 70" in line and "Thread" in err  # followed by the stacks of every thread
        beats = [json.loads((run_dir / "heartbeats" / f"rank_0000{r}.json").read_text()) for r in (0, 1)]
        assert beats[0]["phase"] == "hung" and beats[0]["iteration"] == hung_at
        status = _status(run_dir)
        sys.stderr.write(status)  # shown with -s / on failure
        it1, phase1 = beats[1]["iteration"], beats[1]["phase"]
        stale = f"rank 1 on nodeB (pid {rank1.pid}), iteration {it1}, phase {phase1}"
        assert f"STALE: run run {stale}: no heartbeat for" in status, status
        hung = f"rank 0 on nodeA (pid {rank0.pid}), iteration {hung_at}, watchdog: no training progress for"
        assert f"HUNG: run run {hung}" in status, status
        assert "hung: rank 0@nodeA" in status and "stale: rank 1@nodeB" in status, status
        preflight = json.loads((run_dir / "preflight.json").read_text())
        assert preflight["nodes"] == {"nodeA": [0], "nodeB": [1]} and preflight["problems"] == []
        # The retry (rank 1's node replaced): it resumes, finishes, and the hang stays on record.
        rank1.kill()
        rank1.wait()
        procs = _launch(cfg_file, _free_port(), f"train.iters={hung_at + 2}")
        for p in procs:
            err = p.communicate(timeout=NEVER_S)[1]  # reads the pipe as it fills
            assert p.returncode == 0, err[-3000:]
        status = _status(run_dir)
        assert "ok 2/2" in status or "exited 2/2" in status, status
        recorded = (f"HANG (recorded): run run iteration {hung_at}: stopped progressing: rank 1 on nodeB "
                    f"(pid {rank1.pid}")
        assert recorded in status and "(watchdog fired on rank 0, exit 70)" in status, status
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
