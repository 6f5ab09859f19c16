"""The callables submitit executes on the nodes, one per stage (the job specs they run: orchestrator/jobs.py).

The callables import the trainer's entry points inside the call (the login node never imports torch for a
submit, and the trainer never imports the orchestrator). Each writes the ``_COMPLETE``/``_FAILED`` markers
(jobs.py) into its output directory. Two small pieces the training stage runs around the trainer live
here too: :func:`write_data_report` (the run's copy of what preprocessing dropped).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import submitit

from orchestrator.jobs import (
    ConvertJob,
    CorpusJob,
    PreprocessJob,
    TrainJob,
    Upstream,
)
from orchestrator.queue import process_alive
from trainer import testing_hooks
from trainer.log import get_logger
from trainer.run_files import ATTEMPT_ENV, COMPLETE, FAILED, RunDir
from trainer.signals import (
    EXIT_NONFINITE,
    EXIT_PERMANENT,
    EXIT_REQUEUE,
    FATAL_MARKER,
    STOPPED_MARKER,
    permanent_reason,
)

log = get_logger(__name__)

LOCAL_REQUEUE = 144  # submitit's local controller restarts the tasks on this exit code
# The specs are re-exported: pickles of older runs name this module.
__all__ = ["COMPLETE", "FAILED", "ConvertJob", "CorpusJob", "PreprocessJob", "TrainJob",
           "Upstream", "STAGE_CALLABLES", "wait_for"]


def mark(output_dir: str, name: str, info: dict[str, Any]) -> None:
    path = Path(output_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(info, indent=1, default=str))
    os.replace(tmp, path)


def _rank() -> int:
    try:
        return submitit.JobEnvironment().global_rank
    except RuntimeError:  # not inside a submitit job (a direct call in a test)
        return 0


def _job_alive(up: Upstream) -> bool:
    if up.executor != "local" or not up.job_id:
        return True  # Slurm enforces afterok itself; the marker check below is only for shared storage lag
    return process_alive(up.job_id)


def wait_for(upstream: list[Upstream], timeout_s: float) -> None:
    """Block until every upstream output is complete; raise if one failed (local ``afterok``)."""
    deadline = time.monotonic() + timeout_s
    for up in upstream:
        done = Path(up.output_dir) / COMPLETE
        while not done.exists():
            alive = _job_alive(up)  # read before the markers: a job that just ended has written them
            if (Path(up.output_dir) / FAILED).exists():
                raise RuntimeError(f"upstream stage {up.output_dir} failed; not running (afterok)")
            if not alive and not done.exists():
                raise RuntimeError(f"upstream job {up.job_id} ended without completing {up.output_dir}; "
                                   "not running (afterok)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"upstream {up.output_dir} not complete after {timeout_s:.0f} s")
            time.sleep(1.0)


class Stage(submitit.helpers.Checkpointable):
    """Base callable: wait for upstream, run, write the completion marker (rank 0)."""

    def __init__(
        self,
        job: Any,
        output_dir: str,
        upstream: list[Upstream],
        key: str,
        upstream_timeout_s: float = 3600.0,
    ) -> None:
        self.job, self.output_dir, self.upstream, self.key = job, output_dir, upstream, key
        self.upstream_timeout_s = upstream_timeout_s

    def run(self) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    def __call__(self) -> Any:
        try:
            wait_for(self.upstream, self.upstream_timeout_s)
            result = self.run()
        except Exception as err:
            if _rank() == 0:
                mark(self.output_dir, FAILED, {"key": self.key, "error": repr(err), "time": time.time(),
                                               "reason": f"{type(err).__name__}: {err}"})  # status shows it
            raise
        if _rank() == 0:
            (Path(self.output_dir) / FAILED).unlink(missing_ok=True)
            mark(self.output_dir, COMPLETE, {"key": self.key, "result": result, "time": time.time()})
        return result


class CorpusStage(Stage):
    def run(self) -> dict[str, Any]:
        from trainer.data.corpus import build_corpus

        job: CorpusJob = self.job
        corpus = os.path.join(job.output_dir, "corpus.jsonl")
        summary = build_corpus(job.corpus, corpus)
        out: dict[str, Any] = {"corpus": corpus, "files": summary.files, "bytes": summary.bytes}
        if job.vocab_size:
            out.update(_train_tokenizer(corpus, job))
        return out


def _train_tokenizer(corpus: str, job: CorpusJob) -> dict[str, Any]:
    from trainer.data.train_tokenizer import TokenizerTrainConfig, train_tokenizer

    vocab, merges = train_tokenizer(
        TokenizerTrainConfig(
            inputs=[corpus],
            output_dir=job.output_dir,
            vocab_size=int(job.vocab_size or 0),
            json_key=job.json_key,
        )
    )
    return {"vocab_file": str(vocab), "merge_file": str(merges)}


class PreprocessStage(Stage):
    def run(self) -> dict[str, Any]:
        from trainer.data.preprocess import PreprocessConfig, preprocess

        job: PreprocessJob = self.job
        out = []
        for inp, prefix in zip(job.inputs, job.prefixes, strict=True):
            cfg = PreprocessConfig(
                input=inp,
                output_prefix=prefix,
                json_keys=[job.json_key],
                vocab_file=job.vocab_file,
                merge_file=job.merge_file,
                tokenizer_type=job.tokenizer_type,
                tokenizer_model=job.tokenizer_model,
                append_eod=job.append_eod,
                workers=max(job.workers, 1),
                on_error=job.on_error,
                progress=job.progress,
            )
            out.append(str(preprocess(cfg)))
        return {"prefixes": job.prefixes, "summaries": out}


def write_data_report(summaries: list[str], run_dir: str) -> Path | None:
    """Merge the preprocessing summary files into ``<run_dir>/data_report.json`` (None when none exist).

    The summaries (documents, tokens, and with ``data.on_error=skip`` every dropped line as file:line and
    reason) live in the shared cache; the copy makes a run's directory say what its data lost."""
    found = [json.loads(Path(p).read_text()) for p in summaries if Path(p).is_file()]
    if not found:
        return None
    skipped: dict[str, int] = {}
    for s in found:
        for reason, n in s.get("skipped", {}).items():
            skipped[reason] = skipped.get(reason, 0) + n
    report = {
        "skipped_lines": sum(skipped.values()),
        "skipped": skipped,
        "skipped_examples": [e for s in found for e in s.get("skipped_examples", [])],
        "summaries": found,
    }
    out = RunDir(run_dir).data_report
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, out)
    if report["skipped_lines"]:
        log.warning("the run's data dropped %d bad input line(s) (data.on_error=skip); see %s",
                    report["skipped_lines"], out)
    return out


def _export_torch_env() -> None:
    """RANK/WORLD_SIZE/MASTER_* from the Slurm (or local) job; the sbatch script sets MASTER_ADDR/PORT."""
    env = submitit.helpers.TorchDistributedEnvironment()
    local = os.environ.get("SUBMITIT_EXECUTOR") == "local"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1" if local else env.master_addr)
    os.environ.setdefault("MASTER_PORT", str(env.master_port))
    os.environ.update(
        RANK=str(env.rank),
        WORLD_SIZE=str(env.world_size),
        LOCAL_RANK=str(env.local_rank),
        LOCAL_WORLD_SIZE=str(env.local_world_size),
    )


class TrainStage(Stage):
    """Training: one task per device. Exits with the requeue code when the trainer stopped on a signal.

    Checkpointable: if USR2 arrives before the trainer installed its own handler, submitit's handler calls
    :meth:`checkpoint`, which resubmits this same callable; the trainer resumes from its latest checkpoint.
    """

    def run(self) -> dict[str, Any]:
        job: TrainJob = self.job
        _export_torch_env()
        rank = int(os.environ["RANK"])
        pid_dir = Path(job.run_dir) / "pids"
        pid_dir.mkdir(parents=True, exist_ok=True)
        attempt = os.environ.get(ATTEMPT_ENV, "0")
        restart = os.environ.get("SLURM_RESTART_COUNT", "0")
        (pid_dir / f"rank{rank}.pid").write_text(f"{os.getpid()} {restart} {attempt}\n")
        seam = testing_hooks.seam()  # the test hooks, loaded only under the switch (tests/seam.py)
        if seam is not None:
            testing_hooks.warn_active(log, os.environ)
            seam.train_stage_start()
        if rank == 0:
            write_data_report(job.data_summaries, job.run_dir)
        from trainer.config import RunConfig
        from trainer.run import RunHooks, run

        on_step = seam.train_on_step(self.output_dir, rank) if seam is not None else None
        hooks = RunHooks(on_step=on_step) if on_step is not None else None
        job_id = os.environ.get("SLURM_JOB_ID", "local")  # a relaunch (new job) never reads an old marker
        marker = Path(self.output_dir, FATAL_MARKER.format(job=job_id, restart=restart, attempt=attempt))
        try:
            result = run(RunConfig.from_dict(job.trainer_config), hooks)
        except Exception as err:
            reason = permanent_reason(err)
            if reason is not None:  # the batch script reads the marker and stops instead of retrying
                marker.write_text(f"{EXIT_PERMANENT} {reason.splitlines()[0][:2000]}\n")
                log.error("a retry would repeat this failure; not retrying: %s", reason)
            raise
        code = int(getattr(result, "exit_code", result) or 0)
        if code == EXIT_NONFINITE:
            marker.write_text(f"{EXIT_NONFINITE} non-finite loss or gradient norm\n")
        if code == EXIT_REQUEUE:
            # Local controller requeues on its own code; the sbatch script requeues on the trainer's, or
            # on this marker (every stopping rank writes it, so it exists before the first one exits).
            local = os.environ.get("SUBMITIT_EXECUTOR") == "local"
            Path(self.output_dir, STOPPED_MARKER.format(job=job_id, restart=restart, attempt=attempt)).touch()
            log.warning(
                "trainer stopped for requeue (checkpoint saved); exiting with %s",
                LOCAL_REQUEUE if local else EXIT_REQUEUE,
            )
            sys.exit(LOCAL_REQUEUE if local else EXIT_REQUEUE)
        if code != 0:
            raise RuntimeError(f"trainer exited with code {code}")
        return {"checkpoints": job.trainer_config.get("checkpoint", {}).get("dir"), "rank": rank,
                "iteration": getattr(result, "iteration", None)}

    def __call__(self) -> Any:
        # Only rank 0 writes the markers; the others must not race it with a stale _FAILED.
        return super().__call__()


class ConvertStage(Stage):
    def run(self) -> dict[str, Any]:
        from trainer.convert import convert_run

        job: ConvertJob = self.job
        result = convert_run(job.run_dir, job.config)
        return {"hf": job.config.output_dir, "result": str(result)}


class EvalStage(Stage):
    """HumanEval and perplexity of <run_dir>/hf (trainer/eval); a failed sample is a result, not an error."""

    def run(self) -> dict[str, Any]:
        from trainer.eval.results import RESULTS_FILE, flat_metrics
        from trainer.eval.run import EvalRun, run_eval

        run: EvalRun = self.job  # the trainer's own spec, built by the plan
        return {"results": os.path.join(run.out_dir, RESULTS_FILE), **flat_metrics(run_eval(run))}


STAGE_CALLABLES = {
    "corpus": CorpusStage,
    "preprocess": PreprocessStage,
    "train": TrainStage,
    "convert": ConvertStage,
    "eval": EvalStage,
}
