"""Helpers of the devcluster tests (test_devcluster.py, test_fault_matrix.py): job states, run records,
losses, and the sizes that keep real jobs small on a 2-core machine."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

from orchestrator.readback.status import collect
from orchestrator.record.launches import current_jobs
from orchestrator.world.queue import alive, ended
from tests.slurm_cli import slurm
from tests.waits import JOB_S, wait_until

# Whether a stage is still queued or running is orchestrator.world.queue's (Slurm's vocabulary defined
# once; a state not yet known to accounting counts as alive): a wait must not end on a transient state
# such as SIGNALING (a time limit being signalled).

# The smallest model and batch that still exercise every code path (pinned here, not taken from the
# smoke experiment, whose sizes follow `make demo`).
TINY_MODEL = [
    "model.num_layers=4",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=64",
    "model.max_position_embeddings=64",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.eval_iters=1",
    "train.log_interval=1",
    "optim.warmup_iters=1",
    "data.workers=1",
    "data.split='80,20,0'",
    "cluster.stage_cpus=1",
]


def tiny_dataset(root: Path) -> list[str]:
    """A small JSONL corpus and a BPE trained on it, built here (no corpus job): the overrides that use
    them."""
    from trainer.config import CorpusConfig
    from trainer.data.corpus import build_corpus
    from trainer.data.train_tokenizer import TokenizerTrainConfig, train_tokenizer

    data = root / "corpus.jsonl"
    build_corpus(CorpusConfig(max_files=12, max_bytes=200_000, exclude_tests=True), str(data))
    vocab, merges = train_tokenizer(TokenizerTrainConfig(inputs=[str(data)], output_dir=str(root / "tok"),
                                                         vocab_size=300))
    return ["data.corpus=null", f"data.paths=[{data}]", f"tokenizer.vocab_file={vocab}",
            f"tokenizer.merge_file={merges}"]


def my_jobs() -> dict[str, str]:
    """{job id: state} of every Slipway job in the queue (each carries a ``slipway:`` comment naming its
    run, launch and stage: orchestrator/record/launches.py job_comment; its name is the run's)."""
    jobs = {}
    for line in slurm("squeue", "-h", "-o", "%i|%T|%k").splitlines():
        jid, state, comment = line.split("|", 2)
        if comment.startswith("slipway:"):
            jobs[jid] = state
    return jobs


def newest_job_id() -> int:
    """The highest job id Slurm has handed out so far (sacct knows ended jobs too)."""
    out = slurm("sacct", "-n", "-X", "-a", "-P", "-o", "JobIDRaw", "-S", "now-1day")
    ids = [int(x) for x in out.split() if x.isdigit()] + [int(j) for j in my_jobs()]
    return max(ids, default=0)


def states(run_dir: Path) -> dict[str, str]:
    return {r.stage: r.state for r in collect(str(run_dir))}


def wait_states(run_dir: Path, timeout_s: float = JOB_S) -> dict[str, str]:
    """Block until no stage of the run is queued or running; its final states."""
    def ended_states() -> dict[str, str] | None:
        now = states(run_dir)
        return now if now and all(ended(s) for s in now.values()) else None

    return wait_until(ended_states, f"every job of {run_dir} to end", timeout_s, poll_s=2)


def wait_for(cond: Callable[[], bool], timeout_s: float = JOB_S, what: str = "") -> None:
    wait_until(cond, what, timeout_s, poll_s=0.5)


def job_ids(run_dir: Path) -> dict[str, str]:
    meta = json.loads((run_dir / "run.json").read_text())
    return {stage: entries[-1]["job_id"] for stage, entries in current_jobs(meta).items()}


def losses(run_dir: Path) -> dict[int, float]:
    """lm loss per iteration from the trainer's metrics file (a replayed iteration: the last one wins)."""
    out = {}
    path = run_dir / "train_metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        row = json.loads(line)
        if "train/lm_loss" in row:
            out[int(row["iteration"])] = row["train/lm_loss"]
    return out


def cancel_runs(run_dirs: list[Path]) -> None:
    """scancel whatever jobs of these runs are still queued or running (test teardown)."""
    ids = []
    for run in run_dirs:
        if (run / "run.json").exists():
            now = states(run)
            ids += [j for s, j in job_ids(run).items() if s in now and alive(now[s])]
    if ids:
        subprocess.run(["scancel", *ids], timeout=60, check=False)


def log_text(run_dir: Path, pattern: str) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob(pattern)))
