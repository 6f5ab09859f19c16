"""The port a training task exports from its job: the job script's formula, never submitit's own pick
(anywhere in 20000-60000, the kernel's ephemeral ports included)."""

from __future__ import annotations

import os

import pytest

from orchestrator.stages.trainer_job import export_torch_env
from trainer.formulas import master_port
from trainer.parallel.launch import dist_env

SLURM_TASK = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "123457", "SLURM_ARRAY_JOB_ID": "123450",
              "SLURM_ARRAY_TASK_ID": "7", "SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "1",
              "SLURM_NODEID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "n1"}
LOCAL_TASK = {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_JOB_ID": "31337", "SUBMITIT_LOCAL_NTASKS": "2",
              "SUBMITIT_LOCAL_JOB_NUM_NODES": "1", "SUBMITIT_LOCAL_NODEID": "0",
              "SUBMITIT_LOCAL_GLOBALID": "1", "SUBMITIT_LOCAL_LOCALID": "1"}


@pytest.mark.parametrize("task,job_id", [(SLURM_TASK, 123457), (LOCAL_TASK, 31337)], ids=["slurm", "local"])
def test_a_task_exports_the_job_ids_port(monkeypatch, task, job_id):
    for name in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in task.items():
        monkeypatch.setenv(name, value)
    export_torch_env()
    # An array task's own id (SLURM_JOB_ID), which its sbatch script used too, not "<array>_<task>".
    assert int(os.environ["MASTER_PORT"]) == master_port(job_id) == dist_env().master_port
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("1", "2")


def test_a_port_the_job_script_exported_is_kept(monkeypatch):
    for name, value in {**SLURM_TASK, "MASTER_PORT": "23456"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    export_torch_env()
    assert os.environ["MASTER_PORT"] == "23456"
