"""`status` puts one reason line under the table for every stage that failed: the error the stage's own
callable raised (a real preprocessing failure, a real W&B failure of the training stage), or, for a job
killed without a word, what Slurm's accounting says."""

import json
import socket

import pytest

from orchestrator.readback import status
from orchestrator.stages.corpus import NAME as CORPUS
from orchestrator.stages.preprocess import PreprocessStage
from orchestrator.stages.train import TrainJob, TrainStage
from orchestrator.stages.tune import NAME as TUNE
from tests.orchestrator.conftest import stage_names
from tests.train.harness import tiny_config, write_dataset
from trainer.config_issues import deferred
from trainer.data.preprocess import PreprocessConfig
from trainer.run_files import RUN_JSON


def _local_job_env(monkeypatch) -> None:
    """The environment submitit's local executor gives a one-task job."""
    for name, value in {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_JOB_ID": "2147483646",
                        "SUBMITIT_LOCAL_NTASKS": "1", "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
                        "SUBMITIT_LOCAL_NODEID": "0", "SUBMITIT_LOCAL_GLOBALID": "0",
                        "SUBMITIT_LOCAL_LOCALID": "0", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(name, value)


def test_every_failed_stage_gets_a_reason_line(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # Preprocessing that cannot start: its tokenizer file is missing.
    prep_dir = tmp_path / "cache"
    with deferred():  # as a plan builds it: the files are checked where the job runs
        job = [PreprocessConfig(str(tmp_path / "in.jsonl"), str(prep_dir / "data"),
                                str(tmp_path / "nope" / "vocab.json"), str(tmp_path / "nope" / "merges.txt"),
                                ["content"], append_eod=True, workers=1, progress="log")]
    with pytest.raises(Exception):  # noqa: B017 - whatever it raises, status must show its words
        PreprocessStage(job, str(prep_dir), [], "k")()
    # Training whose W&B must be online and cannot be: the stage raises a WandbError.
    _local_job_env(monkeypatch)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    data = write_dataset(str(tmp_path / "data"))
    cfg = tiny_config(str(run_dir), data, logging={"wandb": {"mode": "online", "require_online": True}})
    train_dir = run_dir / "stages" / "train"
    train_dir.mkdir(parents=True)  # submit creates it
    with pytest.raises(RuntimeError, match="require_online"):
        TrainStage(TrainJob(str(run_dir), cfg), str(train_dir), [], "t")()
    # Convert: a Slurm job killed without a word (no marker): accounting's exit code and reason.
    jobs = {"preprocess": [{"job_id": "2147483645", "executor": "local", "state_dir": str(prep_dir)}],
            "train": [{"job_id": "2147483646", "executor": "local", "state_dir": str(train_dir)}],
            "convert": [{"job_id": "77", "executor": "slurm", "state_dir": str(run_dir / "stages" / "c")}],
            "eval": [{"job_id": "78", "executor": "slurm", "state_dir": str(run_dir / "stages" / "e")}]}
    (run_dir / RUN_JSON).write_text(json.dumps({"jobs": jobs}))
    acct = {"77": {"state": "OUT_OF_MEMORY", "exit": "0:125", "nodes": "n1", "reason": "None",
                   "records": "1"},
            "78": {"state": "CANCELLED", "exit": "0:0", "nodes": "", "reason": "DependencyNeverSatisfied",
                   "records": "1"}}
    monkeypatch.setattr(status, "query_slurm_checked", lambda ids: ({}, acct, ""))
    text = status.format_rows(status.collect(str(run_dir)))
    lines = {ln.split(" stage ")[1].split(" ")[0]: ln for ln in text.splitlines() if ": run run stage " in ln}
    assert set(lines) == set(stage_names(CORPUS, TUNE)), text
    assert "vocab.json" in lines["preprocess"] and lines["preprocess"].startswith("FAILED: run run"), text
    assert f"WandbError: W&B is unreachable from this node (http://127.0.0.1:{port}" in lines["train"], text
    assert "OUT_OF_MEMORY (exit code 0:125); no error was recorded" in lines["convert"], text
    assert "CANCELLED (exit code 0:0, DependencyNeverSatisfied); cancelled: scancel, or an upstream" in \
        lines["eval"], text
