"""What a failing stage adds to a waiting launcher's output: its cause once, and one line per stage that did
not run after it (orchestrator/readback/follow.py, orchestrator/stages/base.py). Each piece alone here; a
real local launch whose training fails: tests/orchestrator/test_local_launch.py.

- A traceback streamed from a log is its exception line alone (a chained one: each exception line);
  everything else passes unchanged, tqdm's carriage returns included, however the text is split.
- A stage whose upstream failed writes its marker (``not_run``) and one log line, and ends without a
  traceback, exiting with the code of a failure a retry would repeat; called outside a job it raises.
- The launcher streams no log of such a stage, and the failure tails skip it and the logs it streamed.
"""

from __future__ import annotations

import io
import json
import logging

import pytest

from orchestrator.readback.follow import Condenser, LogFollower, condensed, failure_tails
from orchestrator.stages import base
from orchestrator.stages.base import NodeStage, mark
from orchestrator.stages.upstream import Upstream, UpstreamFailed
from orchestrator.world.runs import write_json
from trainer.run_files import FAILED, SUBMITIT_LOG, RunDir
from trainer.signals import EXIT_PERMANENT

LOG = """[10:00:00 rank0 INFO x] preprocess: 1 input file(s)
preprocess:   0%|   | 0/9\rpreprocess:  50%|   | 4/9\r
submitit ERROR (2026-12-07 10:00:01,000) - Submitted job triggered an exception
Traceback (most recent call last):
  File "a.py", line 1, in <module>
    f()
    ^^^
ValueError: data.jsonl:19: invalid JSON

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "b.py", line 2, in run
    raise PreprocessError(bad)
trainer.data.preprocess.PreprocessError: data.jsonl:19: invalid JSON. Fix the line
[10:00:02 rank0 INFO x] after
"""
WANT = """[10:00:00 rank0 INFO x] preprocess: 1 input file(s)
preprocess:   0%|   | 0/9\rpreprocess:  50%|   | 4/9\r
ValueError: data.jsonl:19: invalid JSON
trainer.data.preprocess.PreprocessError: data.jsonl:19: invalid JSON. Fix the line
[10:00:02 rank0 INFO x] after
"""


def test_a_traceback_is_its_exception_lines():
    assert condensed(LOG) == WANT
    pieces, c = [], Condenser()
    lines = LOG.splitlines(keepends=True)
    for i in range(0, len(lines), 3):  # as the follower reads it: a few complete lines per poll
        pieces.append(c.lines("".join(lines[i:i + 3])))
    assert "".join(pieces) == WANT


class _Stage(NodeStage):
    def run(self):
        raise AssertionError("never runs: its upstream failed")


def _job_env(monkeypatch, job: str) -> None:
    """What submitit's local executor gives task 0 of job ``job``."""
    for name, value in {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_JOB_ID": job,
                        "SUBMITIT_LOCAL_NTASKS": "1", "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
                        "SUBMITIT_LOCAL_NODEID": "0", "SUBMITIT_LOCAL_GLOBALID": "0",
                        "SUBMITIT_LOCAL_LOCALID": "0"}.items():
        monkeypatch.setenv(name, value)


def test_a_stage_whose_upstream_failed_ends_in_one_line(tmp_path, monkeypatch):
    up, down = tmp_path / "up", tmp_path / "down"
    up.mkdir()
    down.mkdir()
    mark(str(up), FAILED, {"key": "u", "job": "11", "reason": "ValueError: bad line"})
    stage = _Stage(None, str(down), [Upstream(str(up), "11", "local")], "d")
    with pytest.raises(UpstreamFailed, match=r"not run: upstream stage .*up failed \(afterok\)"):
        stage()  # no job: a direct call raises
    _job_env(monkeypatch, "22")
    said: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = said.append
    logging.getLogger(base.log.name).addHandler(handler)
    try:
        with pytest.raises(SystemExit) as ended:
            stage()
    finally:
        logging.getLogger(base.log.name).removeHandler(handler)
    assert ended.value.code == EXIT_PERMANENT
    marker = json.loads((down / FAILED).read_text())
    assert marker["job"] == "22" and marker["not_run"] and marker["reason"].startswith("not run: upstream")
    assert [r.getMessage() for r in said] == [marker["reason"]] and said[0].exc_info is None


def _run_with(tmp_path, stage: str, job: str, text: str, not_run: bool) -> tuple[RunDir, dict]:
    run = RunDir(tmp_path / "run")
    run.jobs(stage).mkdir(parents=True)
    run.stage_state(stage).mkdir(parents=True)
    for task in (0, 1):
        (run.jobs(stage) / SUBMITIT_LOG.format(job=job, task=task, stream="err")).write_text(text)
    if not_run:
        mark(str(run.stage_state(stage)), FAILED, {"job": job, "reason": "not run: x", "not_run": True})
    entry = {"job_id": job, "executor": "local", "folder": str(run.jobs(stage)),
             "state_dir": str(run.stage_state(stage))}
    return run, entry


def test_the_launcher_streams_no_log_of_a_stage_that_did_not_run(tmp_path):
    run, entry = _run_with(tmp_path, "convert", "33", "[t rank0 ERROR x] not run: upstream failed\n", True)
    write_json(run.run_json, {"launches": [{"n": 1, "jobs": {"convert": [entry]}}]})
    out = io.StringIO()
    follower = LogFollower(str(run.root), out)
    follower.poll()
    assert out.getvalue() == ""
    assert failure_tails(str(run.root), ["convert"]) == ""


def test_the_failure_tails_skip_the_streamed_log_and_condense(tmp_path):
    run, entry = _run_with(tmp_path, "train", "44", LOG, False)
    write_json(run.run_json, {"launches": [{"n": 1, "jobs": {"train": [entry]}}]})
    out = io.StringIO()
    follower = LogFollower(str(run.root), out)
    follower.poll()
    assert out.getvalue().endswith(WANT) and "──── train (job 44" in out.getvalue()
    tails = failure_tails(str(run.root), ["train"], streamed=frozenset(follower.offsets))
    assert tails.splitlines()[0] == f"──── train: last lines of {run.jobs('train')}/44_1_log.err ────"
    assert "Traceback" not in tails and tails.count("PreprocessError") == 1
