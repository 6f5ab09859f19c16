"""What every stage is made of, and the machinery they share.

A stage is one module in this package holding a :class:`StageDef`: its name and what it follows, how it
is planned (:meth:`StageDef.plan`, pure: config and facts in, a :class:`StagePlan` with its job spec
out), what it asks the scheduler for (:meth:`StageDef.resources`), the callable that runs on the nodes
(:attr:`StageDef.node`, a :class:`NodeStage`) and what ``status`` shows of it (:meth:`StageDef.status`).
The package's ``__init__`` finds the modules and orders them by what each follows; plan, submit, render
and status iterate over that list and name no stage.

Nothing here imports submitit or torch at module level: planning and the status table load neither
(submitit is imported inside the node-side calls, which run in the job).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from orchestrator.base.facts import PlanInputs
from orchestrator.base.plan_types import JobResources, StagePlan
from orchestrator.base.schema import SlipwayConfig
from orchestrator.render import mem_flag
from orchestrator.stages.upstream import Upstream, UpstreamFailed, wait_for
from orchestrator.world.queue import marker_of
from orchestrator.world.runs import CACHE_DIR, write_json
from trainer import disk
from trainer.formulas import padded_vocab_size, stage_params
from trainer.health import node_name
from trainer.log import get_logger
from trainer.run_files import COMPLETE, FAILED, FAILED_RESERVE, RunDir
from trainer.signals import EXIT_PERMANENT

# Upstream lived here: jobs pickled then name it orchestrator.stages.base.Upstream, which still resolves
# (tests/orchestrator/test_old_pickles).

log = get_logger(__name__)


def stable_hash(obj: Any, n: int = 16) -> str:
    """Hash of a JSON-able object, independent of dict order."""
    blob = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:n]


@dataclass
class PlanContext:
    """What a stage's plan sees: the config, the facts gathered outside the planner, and the stages
    planned before it (by name; a stage that planned nothing is absent)."""

    cfg: SlipwayConfig
    facts: PlanInputs
    planned: dict[str, StagePlan] = field(default_factory=dict)
    proposal: Any = None  # layout=auto: the plan's ranked layouts (orchestrator.planning.autolayout.Proposal)

    @property
    def cache_dir(self) -> str:
        return self.cfg.cache_dir or os.path.join(self.cfg.runs_root, CACHE_DIR)

    @property
    def run(self) -> RunDir:
        return RunDir(self.facts.run_dir)

    def shared_dir(self, stage: str, key: str) -> str:
        """A shared stage's content-addressed output directory in the cache."""
        return os.path.join(self.cache_dir, stage, key)

    def code(self, package: str) -> str | None:
        """The tree hash of ``package`` (e.g. ``trainer/data``): part of every key its output depends on."""
        return self.facts.code_version.get(package)


@dataclass
class StageLook:
    """What ``status`` knows of one stage's latest job: its run directory, the job's record in run.json,
    the run's current launch record, and Slurm accounting's fields for the job (empty when local)."""

    run_dir: Path
    entry: dict[str, Any]
    run: dict[str, Any]
    accounting: dict[str, Any]
    stale_after_s: float | None = None  # a training rank's heartbeat older than this is stale (status)
    state: str = ""  # the job's state as the row shows it (queue.py's words)


class StageDef:
    """One stage. Subclasses set ``name``, ``after`` and ``node`` and implement :meth:`plan`."""

    name: ClassVar[str]
    after: ClassVar[tuple[str, ...]] = ()  # the stages it may depend on: orders the stage list
    node: ClassVar[type[NodeStage]]
    # A single-task job sized by cluster.stage_* (stage_cpus, stage_mem_gb); False: the training layout's.
    stage_job: ClassVar[bool] = True

    def plan(self, ctx: PlanContext) -> StagePlan | None:  # pragma: no cover - every stage has one
        """The stage's plan, or None when this config has no such stage."""
        raise NotImplementedError

    def resources(self, cfg: SlipwayConfig, tasks_per_node: int) -> JobResources:
        """Default: a single-task CPU job on the stage partition, with its memory (:func:`stage_mem_gb`).
        (The job's name, the stage's here, is the run's once submit.stage_job knows the run:
        :func:`job_name`.)"""
        c = cfg.cluster
        return JobResources(self.name, 1, 1, 0, c.stage_cpus, c.stage_time_limit_min,
                            c.stage_partition or c.partition, mem=mem_flag(stage_mem_gb(cfg, self)),
                            **common_resources(cfg))

    def mem_gb(self, cfg: SlipwayConfig) -> float:
        """The memory this stage's single-task job needs, in GB, when cluster.stage_mem_gb does not say
        (the site's default memory per CPU is no measure of it). Default: Python, its libraries and a
        streaming buffer (the corpus stage)."""
        return STAGE_MEM_GB

    def status(self, look: StageLook) -> dict[str, Any]:
        """Fields of the status row beyond the job's state (``readback.status.JobRow``); a stage whose
        job's exit is not its outcome (the tune stage's array, where a failed trial is a result) may
        restate the state."""
        return {}

    def complete(self, stage: StagePlan) -> str | None:
        """Why this stage has nothing to do for this plan (its output exists), or None: it must run. Read
        from its directories when the launch submits (and by the dry run). Default: its ``_COMPLETE``
        marker names this plan's key and :meth:`outputs` are all there."""
        marker = marker_of(stage.state_dir, COMPLETE, None)
        if marker is None or marker.get("key", stage.key) != stage.key:
            return None
        missing = [str(p) for p in self.outputs(stage) if not p.exists()]
        return None if missing else f"complete for key {stage.key} ({stage.state_dir})"

    def outputs(self, stage: StagePlan) -> list[Path]:
        """The files whose absence makes a complete stage run again (a deleted hf/ or eval/, say)."""
        return []


# Slurm keeps a job's name whole up to 255 bytes: slurmctld accepts 1024 (longer is refused), but
# accounting stores 255 (slurmdbd's job_name column), so sacct would show a longer name cut. Measured on
# the devcluster (Slurm 22.05): a 300-byte name reads back from sacct as 255 bytes.
JOB_NAME_MAX = 255


def job_name(experiment: str, run_id: str, stage: str) -> str:
    """``<experiment>-<run_id>-<stage>``: what ``squeue`` shows of a job, so runs (and a sweep's points)
    are told apart there. Within :data:`JOB_NAME_MAX` bytes: the run id and the stage are kept whole and
    the experiment is shortened (a run id that alone is too long keeps its end, the random part)."""
    tail = f"-{run_id}-{stage}"
    room = JOB_NAME_MAX - len(tail.encode())
    if room <= 0:
        return f"{run_id}-{stage}".encode()[-JOB_NAME_MAX:].decode(errors="ignore").lstrip("-")
    return experiment.encode()[:room].decode(errors="ignore") + tail


STAGE_MEM_GB = 2.0  # a single-task stage job's floor: Python, torch imported, buffers


def stage_mem_gb(cfg: SlipwayConfig, stage: StageDef) -> float:
    """The --mem of a single-task stage job in GB: cluster.stage_mem_gb, or the stage's own figure
    (:meth:`StageDef.mem_gb`) rounded up to whole GB."""
    own = cfg.cluster.stage_mem_gb
    return float(own) if own is not None else float(math.ceil(stage.mem_gb(cfg)))


GPT2_VOCAB = 50257  # the vocabulary a model's memory is sized for when neither config states one


def model_params(cfg: SlipwayConfig) -> int:
    """The model's parameter count, for the memory of the jobs that hold it whole (convert, eval). The
    vocabulary is model.vocab_size, else tokenizer.vocab_size, else GPT-2's (the tokenizer files' size is
    read by the plan, not here)."""
    m = cfg.model
    vocab = m.vocab_size or cfg.tokenizer.vocab_size or GPT2_VOCAB
    try:
        return stage_params(m, padded_vocab_size(vocab, 1, m.make_vocab_size_divisible_by))[1]
    except (ArithmeticError, TypeError, ValueError):  # sizes the plan refuses (heads=0): its problems say so
        return 0


def common_resources(cfg: SlipwayConfig) -> dict[str, Any]:
    """What every stage's job asks for alike: account, QoS, constraint and the extra sbatch flags."""
    c = cfg.cluster
    return {"account": c.account, "qos": c.qos, "constraint": c.constraint,
            "extra": tuple(sorted(c.sbatch_extra.items()))}


def mark(output_dir: str, name: str, info: dict[str, Any]) -> None:
    write_json(Path(output_dir) / name, info)


def failure_reason(err: BaseException) -> str:
    """A stage's error in one line for its _FAILED marker (status shows it); a full disk says so."""
    reason = f"{type(err).__name__}: {err}"
    return reason if not disk.out_of_space(err) or "disk full" in reason else f"disk full: {reason}"


def reserve_marker(output_dir: str) -> None:
    """Take the space of a _FAILED marker now (``FAILED_RESERVE``, trainer.disk.reserve), so that a stage
    whose disk fills up still reports why it failed (:func:`mark_failed`)."""
    with contextlib.suppress(OSError):
        os.makedirs(output_dir, exist_ok=True)
    disk.reserve(str(Path(output_dir) / FAILED_RESERVE))


def mark_failed(output_dir: str, info: dict[str, Any]) -> None:
    """The _FAILED marker. When the disk is too full to write it, it goes through the space the stage
    reserved at its start (:func:`reserve_marker`), its texts shortened to fit: a failure is reported as
    what it was even when its own marker could not otherwise be written."""
    reserved = Path(output_dir) / FAILED_RESERVE
    try:
        mark(output_dir, FAILED, info)
    except OSError:
        if not reserved.is_file():
            raise
        short = {k: v[:2000] if isinstance(v, str) else v for k, v in info.items()}
        disk.write_reserved(str(Path(output_dir) / FAILED), str(reserved), json.dumps(short, default=str))
    reserved.unlink(missing_ok=True)


def mark_complete(output_dir: str, info: dict[str, Any]) -> None:
    """The _COMPLETE marker; a disk too full to write it fails the stage, saying so."""
    try:
        mark(output_dir, COMPLETE, info)
    except OSError as err:
        mark_failed(output_dir, {"key": info.get("key"), "job": info.get("job"), "error": repr(err),
                                 "time": time.time(), "reason": failure_reason(err)})
        raise
    (Path(output_dir) / FAILED_RESERVE).unlink(missing_ok=True)


def job_of_task() -> str:
    """This task's job id as the launch recorded it (Slurm's, or the local controller's pid); "local"
    outside a submitit job."""
    return _job()[1] or "local"


def _job() -> tuple[int, str | None]:
    """(global rank, job id) of this task as submitit sees it: Slurm's job id, or the local controller's pid
    (the id the launch recorded); (0, None) outside a submitit job (a direct call in a test)."""
    import submitit

    try:
        env = submitit.JobEnvironment()
    except RuntimeError:
        return 0, None
    return env.global_rank, str(env.job_id)


def _where() -> dict[str, str]:
    """The node (Slurm's name) and host a marker was written on: where an output came from."""
    return {"node": node_name(), "host": socket.gethostname()}


class NodeStage:
    """The callable submitit runs on the nodes: wait for upstream, run, write the completion marker (rank 0).

    Every stage writes ``run_files.COMPLETE`` into its output directory when it succeeded and
    ``run_files.FAILED`` when it raised, so later launches can reuse complete outputs and local jobs
    (which have no Slurm ``afterok``) can wait on their upstream.
    """

    def __init__(self, job: Any, output_dir: str, upstream: list[Upstream], key: str,
                 upstream_timeout_s: float = 3600.0) -> None:
        self.job, self.output_dir, self.upstream, self.key = job, output_dir, upstream, key
        self.upstream_timeout_s = upstream_timeout_s

    def run(self) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    def failed(self, err: Exception) -> None:
        """What the stage records of a failure of this task, before it is raised (waiting for upstream
        included); nothing by default."""

    def __call__(self) -> Any:
        rank, job = _job()
        if rank == 0:  # room for _FAILED, taken before the work can fill the disk
            reserve_marker(self.output_dir)
        try:
            try:
                wait_for(self.upstream, self.upstream_timeout_s)
            except UpstreamFailed as err:
                self._not_run(rank, job, err)  # its own marker and line; raises
            result = self.run()
        except KeyboardInterrupt:
            if job is None:
                raise
            # SIGINT reaches a job's processes only from Slipway's cancel (local_jobs.cancel; an interrupted
            # launch.py): the cause, in one line, ends the log instead of a traceback.
            log.warning("job %s rank %d interrupted by SIGINT: the job was cancelled (Ctrl-C or a signal to "
                        "launch.py, or python -m orchestrator cancel); launch the same run_id again to "
                        "resume", job, rank)
            raise SystemExit(128 + signal.SIGINT) from None
        except Exception as err:
            if not isinstance(err, UpstreamFailed):  # not_run is already its marker
                self.failed(err)
                if rank == 0:
                    mark_failed(self.output_dir, {"key": self.key, "job": job, "error": repr(err), **_where(),
                                                  "time": time.time(), "reason": failure_reason(err)})
            raise
        if rank == 0:  # only rank 0 writes the markers; the others must not race it with a stale _FAILED
            (Path(self.output_dir) / FAILED).unlink(missing_ok=True)
            mark_complete(self.output_dir, {"key": self.key, "job": job, "result": result, **_where(),
                                            "time": time.time()})
        return result

    def _not_run(self, rank: int, job: str | None, err: UpstreamFailed) -> None:
        """Upstream failed: this stage's outcome is that one line (its marker, its log), not an error of its
        own, so it ends without a traceback (which the launcher would stream beside the real cause). In a
        job it exits with the code of a failure a retry would repeat (a Slurm train job's batch script then
        stops); called directly (no job), it raises."""
        if rank == 0:
            mark_failed(self.output_dir, {"key": self.key, "job": job, "error": repr(err),
                                          "time": time.time(), "reason": str(err), "not_run": True})
        if job is None:
            raise err
        log.error("%s", err)
        raise SystemExit(EXIT_PERMANENT)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """submitit calls this on USR2 or a timeout (it looks for the method, not a base class): resubmit
        this same callable, as ``submitit.helpers.Checkpointable`` does. Training resumes from its latest
        checkpoint; the other stages redo their work."""
        from submitit.core.utils import DelayedSubmission

        return DelayedSubmission(self, *args, **kwargs)
