"""Preconditions of a submission that read the outside world (files, the queue), checked after the plan.

- Reused data: a preprocessing output found complete in the cache is opened and validated like the
  trainer would (``.idx`` header and offsets, ``.bin`` length), so a truncated or corrupt file is refused
  here, naming the file and the problem, instead of failing a job on the cluster.
- One writer per run: a launch holds a lock on the run directory and on the checkpoint directory while it
  records and submits, and refuses when a job of the same run is still queued or running, or when another
  run's active job writes the same checkpoint directory (``.slipway-writer.json`` there). Two launches of
  one run therefore never write one checkpoint directory at the same time; relaunching a run whose jobs
  have all ended resumes it from its checkpoints.
- pyxis: with ``container=pyxis`` the jobs' srun must know the ``--container-*`` options they use. pyxis
  is a SPANK plugin, and a loaded plugin's options are listed by ``srun --help``; without them the jobs
  would fail on their first srun, after their queue wait.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from orchestrator import launches
from orchestrator.container import PYXIS_OPTIONS
from orchestrator.plan import Plan
from orchestrator.queue import ended, live_state, local_state, query_slurm
from orchestrator.runs import hf_vocab_entries, vocab_entries, write_json
from orchestrator.schema import SlipwayConfig
from orchestrator.stages.preprocess import NAME as PREPROCESS
from orchestrator.stages.train import NAME as TRAIN
from orchestrator.validate import PlanError, Problem
from trainer.checkpoint import verify as ckpt_verify
from trainer.data.hf_tokenizer import HF_TOKENIZER_TYPE
from trainer.formulas import model_vocab_size
from trainer.run_files import COMPLETE, RUN_JSON

LOCK = ".slipway-launch.lock"
WRITER = ".slipway-writer.json"


def reused_data_problems(plan: Plan) -> list[Problem]:
    """Problems with a preprocessing output the launch would reuse (none when it will be built)."""
    prep = plan.stage(PREPROCESS)
    if not (Path(prep.state_dir) / COMPLETE).exists():
        return []
    from trainer.data.indexed_dataset import IndexedDataset, IndexedDatasetError

    out = []
    for prefix in [c.output_prefix_for(key) for c in prep.job for key in c.json_keys]:
        try:
            IndexedDataset(prefix).close()
        except IndexedDatasetError as err:
            out.append(Problem(
                "data_corrupt", "cache_dir", prep.state_dir,
                f"the cached preprocessed data this run would train on is unusable: {err}",
                f"delete the cache entry (rm -r {prep.state_dir}) and launch again; the preprocess stage "
                "rebuilds it from the inputs"))
    return out


def checkpoint_problems(plan: Plan) -> list[Problem]:
    """What the training job would find in the checkpoint directory it resumes from, checked cheaply now
    (sizes against each manifest; the job also verifies checksums): a damaged latest checkpoint or a
    missing/garbage tracker becomes a warning (the job loads the newest good one); checkpoints of which
    none verifies are a problem (the job would refuse to start rather than overwrite them)."""
    ck = plan.stage(TRAIN).job.trainer_config["checkpoint"]
    if ck.get("load") not in (None, "latest") or not os.path.isdir(ck["dir"]):
        return []
    try:
        choice = ckpt_verify.choose_latest(ck["dir"], full=False, act=False)
    except ckpt_verify.NoVerifiedCheckpoint as err:
        return [Problem("checkpoint_damaged", "checkpoint.dir", ck["dir"], str(err),
                        "restore a good copy of a checkpoint, or start a new run (no run_id, or another "
                        "checkpoint.dir); damaged folders are never deleted")]
    plan.warnings.extend(f"{w} (the training job will load iteration {choice.iteration} instead)"
                         if "failed verification" in w else w for w in choice.warnings)
    return model_problems(plan, ck["dir"], choice.iteration) if choice.iteration is not None else []


def model_problems(plan: Plan, ckpt_dir: str, iteration: int) -> list[Problem]:
    """The checkpoint the training job would resume from must be the configured model: the trainer's
    own comparison (trainer.checkpoint.files.config_differences: shape and architecture), made here so
    that a relaunch with a changed model section is refused before anything is submitted or recorded."""
    from trainer.checkpoint.files import CheckpointError, config_differences
    from trainer.checkpoint.protocol import saved_layout
    from trainer.checks import ConfigError
    from trainer.config import ModelConfig

    try:
        args = saved_layout(ckpt_dir, iteration, mmap=True)[2]
    except CheckpointError:
        return []  # not a Slipway checkpoint (torch_dist, foreign): the trainer says what to do with it
    tc = plan.stage(TRAIN).job.trainer_config
    model = dict(tc["model"])
    tok = tc["tokenizer"]  # the tokenizer is read only when its size matters (loading one takes seconds)
    entries = None if model.get("vocab_size") else (
        hf_vocab_entries(tok.get("model")) if tok.get("type") == HF_TOKENIZER_TYPE
        else vocab_entries(tok.get("vocab_file")))
    model["vocab_size"] = model_vocab_size(model.get("vocab_size"), entries)  # as the trainer builds it
    try:
        wrong = config_differences(args, ModelConfig(**model))
    except (ConfigError, TypeError, ValueError):
        return []  # a broken model section: the config checks report it
    if not wrong:
        return []
    diffs = ", ".join(f"{k} {saved} → {now}" for k, (saved, now) in wrong.items())
    old = " ".join(f"model.{k}={saved}" for k, (saved, _) in wrong.items())
    return [Problem(
        "checkpoint_model", "model", diffs,
        f"the run's checkpoints ({ckpt_dir}, iteration {iteration}) are a different model (saved → "
        f"configured): {diffs}; the training job would refuse to load them",
        f"start a new run (another run_id; to start from these weights use checkpoint.load=model-only "
        f"checkpoint.load_dir={ckpt_dir}), or keep the old values: {old}")]


def checkpoint_dir(plan: Plan) -> str:
    return plan.stage(TRAIN).job.trainer_config["checkpoint"]["dir"]


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _latest_entries(data: dict[str, Any]) -> list[tuple[int, str, dict[str, Any]]]:
    """(launch, stage, entry) of each launch's last job per stage, except launches whose outcome is
    recorded (their jobs ended)."""
    return [(r.get("n", 1), stage, es[-1]) for r in launches.history(data) if not r.get("outcome")
            for stage, es in r.get("jobs", {}).items() if es]


def active_jobs(plan: Plan) -> list[str]:
    """Descriptions of the queued/running jobs of this run (any launch) and of the checkpoint directory's
    writer."""
    found: list[str] = []
    seen: set[str] = set()
    data = _read(Path(plan.run_dir) / RUN_JSON)
    last = len(launches.history(data))
    for n, stage, e in _latest_entries(data):
        state = live_state(str(e["job_id"]), e.get("executor", "slurm"))
        seen.add(str(e["job_id"]))
        if state:
            by = "" if n == last and not e.get("adopted") else f" submitted by launch {n}"
            by += " (which died before recording it)" if e.get("adopted") else ""
            found.append(f"{stage} job {e['job_id']} ({state}){by}")
    writer = _read(Path(checkpoint_dir(plan)) / WRITER)
    if writer and str(writer.get("job_id")) not in seen:
        state = live_state(str(writer["job_id"]), writer.get("executor", "slurm"))
        if state:
            found.append(f"train job {writer['job_id']} of run {writer.get('run_dir')} ({state}), which "
                         f"writes {checkpoint_dir(plan)}")
    return found


def _run_active(plan: Plan, active: list[str]) -> Problem:
    return Problem(
        "run_active", "run_id", plan.run_id,
        f"this run is already launched: {'; '.join(active)}. A second launch would write "
        f"{checkpoint_dir(plan)} at the same time",
        f"follow it with python -m orchestrator status {plan.run_dir}; to relaunch, wait until it "
        "ends or cancel it first (scancel)")


def active_problems(plan: Plan) -> list[Problem]:
    """The dry run's ``run_active``: what :func:`single_writer` would refuse (reads only), the jobs a dead
    launch submitted without recording them included."""
    active = active_jobs(plan)
    try:
        active += [f"{stage} job {jid} ({state}) submitted by launch {n}, which died before recording it"
                   for n, stage, jid, state in launches.orphans(plan.run_dir) if jid]
    except RuntimeError as err:
        active.append(str(err))
    return [_run_active(plan, active)] if active else []


def record_outcomes(run_dir: str) -> None:
    """Before a new launch: the final job states of earlier launches (their jobs have all ended)."""
    entries = _latest_entries(_read(Path(run_dir) / RUN_JSON))
    _, sa = query_slurm([str(e["job_id"]) for _, _, e in entries if e.get("executor", "slurm") == "slurm"])
    states = {str(e["job_id"]): local_state(e) if e.get("executor") == "local"
              else sa.get(str(e["job_id"]), {}).get("state", "UNKNOWN") for _, _, e in entries}
    # a state accounting does not know yet is left out: a later launch records it
    launches.add_outcomes(run_dir, {j: st for j, st in states.items() if ended(st)})


@contextmanager
def single_writer(plan: Plan) -> Iterator[None]:
    """Hold the launch locks of the run and checkpoint directories; refuse while another writer is active."""
    created = [d for d in (checkpoint_dir(plan), plan.run_dir) if not os.path.isdir(d)]
    with ExitStack() as stack:
        for d in sorted({plan.run_dir, checkpoint_dir(plan)}):  # one order everywhere: no deadlock
            os.makedirs(d, exist_ok=True)
            f = stack.enter_context(open(os.path.join(d, LOCK), "a"))
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            launches.reconcile(plan.run_dir)  # a dead launch's unrecorded job is recorded first
            active = active_jobs(plan)
        except RuntimeError as err:  # squeue cannot say whether a dead launch's job is queued
            active = [str(err)]
        if active:
            for d in created:  # a refused launch leaves nothing behind
                Path(d, LOCK).unlink(missing_ok=True)
                _rmdir(d)
            raise PlanError([_run_active(plan, active)])
        if os.path.exists(os.path.join(plan.run_dir, RUN_JSON)):
            record_outcomes(plan.run_dir)
        yield


def _rmdir(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


def record_writer(plan: Plan, job_id: str | None, executor: str) -> None:
    """Name the training job as the checkpoint directory's writer (read by later launches)."""
    if job_id:
        write_json(Path(checkpoint_dir(plan)) / WRITER,
                   {"run_id": plan.run_id, "run_dir": plan.run_dir, "job_id": job_id, "executor": executor})


def pyxis_problems(cfg: SlipwayConfig, timeout_s: float = 30.0) -> list[Problem]:
    """container=pyxis on Slurm: the srun on this node's PATH lists pyxis's options (``srun --help``)."""
    if cfg.container.kind != "pyxis" or cfg.cluster.executor != "slurm":
        return []  # the local executor is refused by validate.py (container_local)
    fix = ("use container=apptainer_ngc or container=none; if the site has pyxis, run the launch where its "
           "srun loads it (plugstack.conf), e.g. on the cluster's login node")
    try:
        out = subprocess.run(["srun", "--help"], capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        return [Problem("pyxis_missing", "container.kind", "pyxis", "srun is not on this node's PATH", fix)]
    except subprocess.TimeoutExpired:
        return [Problem("pyxis_missing", "container.kind", "pyxis",
                        f"srun --help did not answer within {timeout_s:.0f} s", fix)]
    listed = out.stdout + out.stderr
    missing = [o for o in PYXIS_OPTIONS if o not in listed]
    if not missing:
        return []
    if len(missing) == len(PYXIS_OPTIONS):
        return [Problem("pyxis_missing", "container.kind", "pyxis",
                        "srun --help lists no --container-* option: pyxis is not loaded here", fix)]
    return [Problem("pyxis_missing", "container.kind", "pyxis",
                    f"srun --help does not list {', '.join(missing)}: this pyxis is older than the jobs need "
                    "(--container-env came with pyxis 0.15)", "ask the site to update pyxis, or " + fix)]
