"""The files of a run, named once: the contract between the launcher (``orchestrator/``), which plans and
reads a run, and the trainer, which writes it. Torch-free and import-free, so both sides and the status
table can import it. A module that needs a run's file asks :class:`RunDir` (or uses a name below); a
literal file name of a run anywhere else is a second copy (tests/test_run_files.py fails on it).

    <run_dir>/
      run.json                 what was launched: stages, jobs, config (orchestrator/world/runs.py)
      config.yaml              link to the latest launch's resolved config (launches/<n>/config.yaml)
      launches/<n>/            each launch: config.yaml, scripts/
      .slipway-launch.lock     held while a launch records and submits (also in the checkpoint dir, with
                               .slipway-writer.json, the job writing it: orchestrator/record/writer_lock.py)
      checkpoints/             Megatron's layout: iter_XXXXXXX/, latest_checkpointed_iteration.txt
      hf/                      the converted Hugging Face model, always a verified one: the next is built
                               in hf.partial/ and renamed in; hf.previous/ holds the old one during the
                               swap (trainer/convert/swap.py)
      eval/                    results.json of the eval stage
      logs/                    job logs (train_<jobid>_r<restart>_a<attempt>_<rank>.err, ...)
      jobs/<stage>/            submitit's pickles, local logs (<job>_<task>_log.err/.out), <job>_exits.jsonl
      stages/<stage>/          stage state: _COMPLETE / _FAILED markers (_FAILED.reserve while it runs),
                               requeues, retries, fatal_*
      heartbeats/              rank_<rank>.json per training rank; hangs.jsonl beside it (trainer/health)
      wandb_run.json           the W&B run id, so a restart resumes the same run
      train_metrics.jsonl      the trainer's log-line values, one JSON object per line
      data_report.json         the preprocessing summaries of the run's data
      tune/                    layout=auto tune=true: layout_table.json/.txt (the measured ranking and the
                               decision training took), trial_<i>/ (each trial's own run directory:
                               trial.json spec, trial_rank<r>.json outcomes, its metrics, logs, heartbeats)
      sample.txt               the converted model's sample continuation
      loss.png                 the loss curve (``python -m orchestrator status RUN --plot``)
      summary.txt              what a finished local run printed (orchestrator/readback/summary.py)
      bad_nodes.jsonl          every node a preflight or hang watchdog named, and why (trainer/health)
      bad_nodes/               per attempt and reporter: the nodes the batch script keeps out of the next
      goodput/                 one record per training attempt: where its wall time went (trainer/goodput)
      compile_cache/           torch.compile's (Inductor's) cache, so a requeued job does not compile again
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

RUN_JSON = "run.json"
CONFIG = "config.yaml"
LAUNCHES = "launches"
LAUNCH_LOCK = ".slipway-launch.lock"  # in the run and checkpoint directories
CKPT_WRITER = ".slipway-writer.json"  # in the checkpoint directory: the run and job writing it
HEARTBEATS = "heartbeats"
HANGS = "hangs.jsonl"  # one line per watchdog that fired: kept across retries (heartbeats are not)
CHECKPOINTS = "checkpoints"
HF = "hf"
# Beside a converted model's folder (any output folder of the converter, not only a run's hf/): the model
# being built and verified, and the one it replaces while the two are swapped (trainer/convert/swap.py).
PARTIAL_SUFFIX = ".partial"
PREVIOUS_SUFFIX = ".previous"
EVAL = "eval"
LOGS = "logs"
JOBS = "jobs"
STAGES = "stages"
WANDB_RUN = "wandb_run.json"
WANDB_DIR = "wandb"  # W&B's own folder under the dir wandb.init is given (the run dir): offline-run-*/
METRICS = "train_metrics.jsonl"
DATA_REPORT = "data_report.json"
SAMPLE = "sample.txt"
LOSS_PLOT = "loss.png"
SUMMARY = "summary.txt"
PIDS = "pids"  # the fault plugin's (trainer/faults.py): "<pid> <restart> <attempt>" per training rank
BAD_NODES = "bad_nodes.jsonl"  # one JSON line per node a preflight or watchdog named (status reads it)
BAD_NODES_DIR = "bad_nodes"  # per attempt: "<node>\t<why>" lines (the batch script reads them)
# A file of BAD_NODES_DIR: one per job attempt and reporting process (no two ranks write the same file).
BAD_NODES_MARKER = "{job}_r{restart}_a{attempt}.{reporter}"
COMPILE_CACHE = "compile_cache"  # TORCHINDUCTOR_CACHE_DIR of the run's jobs (trainer/run/kernels.py)
GOODPUT = "goodput"  # one JSON record per training attempt (trainer/goodput), rewritten while it runs
# An attempt's record: its clock's start (ms since the epoch: the names sort in time order) and job.
GOODPUT_RECORD = "{start_ms:013d}_{job}_r{restart}_a{attempt}.json"

# layout=auto's trials (orchestrator/stages/tune.py) and the decision (orchestrator/tuning.py).
TUNE = "tune"
LAYOUT_TABLE = "layout_table.json"  # the ranked trials and the layout training took (kept: a relaunch
LAYOUT_TABLE_TEXT = "layout_table.txt"  # reuses the decision); the same table for people
TRIAL_SPEC = "trial.json"  # a trial's trainer config and what it measures
TRIAL_RECORD = "trial_rank{rank}.json"  # what one rank of a trial ended with (measured, or why not)

# Stage state (in stages/<stage>/, or a shared stage's output folder).
COMPLETE = "_COMPLETE"  # the stage succeeded; its JSON holds the stage's result
FAILED = "_FAILED"  # the stage's callable raised; its JSON holds the error
FAILED_RESERVE = "_FAILED.reserve"  # space for _FAILED taken at a stage's start (a full disk still reports)
REQUEUES = "requeues"  # one line per requeue of the training job (Slipway's or Slurm's)
RETRIES = "retries"  # one line per crashed attempt retried inside the allocation
EXCLUSIONS = "exclusions"  # one line per bad-node decision of the batch script: excluded (or kept)
JOB_RECORD = "_JOB.json"  # a shared stage's queued job, in its output folder (read by every run's launch)
# Markers a training attempt leaves for the sbatch loop (orchestrator/render.py renders the same names
# with shell variables): stopped after a checkpoint (requeue me), or failed in a way a retry would repeat
# ("<exit code> <reason>"). Keyed by job id, so a relaunch never reads an old one.
STOPPED_MARKER = "stopped_{job}_r{restart}_a{attempt}"
FATAL_MARKER = "fatal_{job}_r{restart}_a{attempt}"

# Job logs: a Slurm job's in logs/ (render.py names them <stage>_<job>_r<restart>_a<attempt>_<task>.err,
# <stage>_<job>_batch.out, ...), submitit's per task in the job folder (its JobPaths names).
SLURM_LOGS = "{stage}_{job}_*.{stream}"
SUBMITIT_LOG = "{job}_{task}_log.{stream}"
# A local job's controller (orchestrator/world/local_jobs.py), in the job's submitit folder: one JSON line
# per task that ended (attempt, task, pid, exit code or -signal, time), in the order it saw them.
LOCAL_EXITS = "{job}_exits.jsonl"

# The environment variable the training job script sets per attempt (0, 1, ...), read by the stage.
ATTEMPT_ENV = "SLIPWAY_ATTEMPT"
# When the job's allocation began (seconds since the epoch): Slurm's SLURM_JOB_START_TIME where it sets one
# (23.02 on), else the batch script's own start; the goodput records' allocation start (trainer/goodput).
ALLOC_START_ENV = "SLIPWAY_ALLOC_START"


# The shared data stages' outputs (in their cache folders): the corpus stage's JSONL and the BPE it trains,
# and the preprocessing output prefixes (see preprocess_prefixes).
CORPUS_FILE = "corpus.jsonl"
VOCAB_FILE = "vocab.json"  # the names tokenizers' ByteLevelBPETokenizer.save_model writes
MERGE_FILE = "merges.txt"
DATA_PREFIX = "data"

DEFAULT_JSON_KEY = "content"  # the JSON field with the text (CodeParrot's); part of the prefix below


def document_prefix(output_prefix: str, json_key: str) -> str:
    """The dataset prefix preprocessing writes for one JSON key (Megatron's preprocess_data.py rule):
    ``{output_prefix}_{json_key}_document`` (.bin/.idx)."""
    return f"{output_prefix}_{json_key}_document"


def preprocess_prefixes(output_dir: str, inputs: int) -> list[str]:
    """One output prefix per preprocessed input: ``data``, or ``data0``, ``data1``... for several."""
    if inputs == 1:
        return [os.path.join(output_dir, DATA_PREFIX)]
    return [os.path.join(output_dir, f"{DATA_PREFIX}{i}") for i in range(inputs)]


def preprocess_summary(output_prefix: str) -> str:
    """What one preprocessing run read, wrote and dropped (JSON), beside its ``.bin/.idx``."""
    return f"{output_prefix}_summary.json"


@dataclass(frozen=True)
class RunDir:
    """Every path of one run."""

    root: Path

    def __init__(self, root: str | Path) -> None:
        object.__setattr__(self, "root", Path(root))

    run_json = property(lambda self: self.root / RUN_JSON)
    config = property(lambda self: self.root / CONFIG)
    launches = property(lambda self: self.root / LAUNCHES)
    checkpoints = property(lambda self: self.root / CHECKPOINTS)
    hf = property(lambda self: self.root / HF)
    hf_partial = property(lambda self: self.root / (HF + PARTIAL_SUFFIX))
    hf_previous = property(lambda self: self.root / (HF + PREVIOUS_SUFFIX))
    eval = property(lambda self: self.root / EVAL)
    logs = property(lambda self: self.root / LOGS)
    wandb_run = property(lambda self: self.root / WANDB_RUN)
    wandb = property(lambda self: self.root / WANDB_DIR)
    metrics = property(lambda self: self.root / METRICS)
    data_report = property(lambda self: self.root / DATA_REPORT)
    sample = property(lambda self: self.root / SAMPLE)
    loss_plot = property(lambda self: self.root / LOSS_PLOT)
    summary = property(lambda self: self.root / SUMMARY)

    heartbeats = property(lambda self: self.root / HEARTBEATS)
    hangs = property(lambda self: self.root / HANGS)
    pids = property(lambda self: self.root / PIDS)
    bad_nodes = property(lambda self: self.root / BAD_NODES)
    bad_nodes_dir = property(lambda self: self.root / BAD_NODES_DIR)
    goodput = property(lambda self: self.root / GOODPUT)
    compile_cache = property(lambda self: self.root / COMPILE_CACHE)

    def goodput_record(self, start_ms: int, job: str, restart: str, attempt: str) -> Path:
        return self.goodput / GOODPUT_RECORD.format(start_ms=start_ms, job=job, restart=restart,
                                                    attempt=attempt)

    def heartbeat(self, rank: int) -> Path:
        return self.heartbeats / f"rank_{rank:05d}.json"

    def launch(self, n: int) -> Path:
        """Launch ``n``'s folder: its config.yaml and scripts/."""
        return self.launches / f"{n:03d}"

    def rank_pid(self, rank: int) -> Path:
        return self.pids / f"rank{rank}.pid"

    def jobs(self, stage: str) -> Path:
        return self.root / JOBS / stage

    tune = property(lambda self: self.root / TUNE)
    layout_table = property(lambda self: self.root / TUNE / LAYOUT_TABLE)
    layout_table_text = property(lambda self: self.root / TUNE / LAYOUT_TABLE_TEXT)

    def trial(self, index: int) -> Path:
        """Trial ``index``'s own run directory (the trainer's run_dir in the trial)."""
        return self.root / TUNE / f"trial_{index}"

    def trial_spec(self, index: int) -> Path:
        return self.trial(index) / TRIAL_SPEC

    def trial_record(self, index: int, rank: int) -> Path:
        return self.trial(index) / TRIAL_RECORD.format(rank=rank)

    def stage_state(self, stage: str) -> Path:
        return self.root / STAGES / stage
