"""The train stage: the trainer on the GPU layout, in the run directory. Its job is the dict that
``trainer.config.RunConfig.from_dict`` reads (every trainer section as the user set it, plus what the plan
derives); its batch script requeues on a stop and retries a crash (render.py); ``status`` shows its loss,
checkpoint, restarts, heartbeats, hangs and W&B run."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.base.plan_types import JobResources, StagePlan
from orchestrator.base.schema import SlipwayConfig
from orchestrator.render import mem_flag
from orchestrator.stages import preprocess, tune, tuning
from orchestrator.stages.base import (
    NodeStage,
    PlanContext,
    StageDef,
    StageLook,
    common_resources,
    job_of_task,
    stable_hash,
)
from orchestrator.stages.trainer_job import export_torch_env, run_name, trainer_config
from orchestrator.stages.upstream import Upstream
from orchestrator.world import progress, queue
from orchestrator.world.runs import write_json
from trainer import faults
from trainer.checkpoint.verify import read_warnings
from trainer.config import RunConfig
from trainer.data.tokenizer_identity import data_refusal, identify
from trainer.health import read_heartbeats, summarize
from trainer.log import get_logger
from trainer.metrics_file import kernel_cell, kernel_fallbacks, last_kernel_check
from trainer.run_files import ATTEMPT_ENV, FATAL_MARKER, STOPPED_MARKER, RunDir
from trainer.signals import (
    EXIT_NONFINITE,
    EXIT_PERMANENT,
    EXIT_REQUEUE,
    permanent_reason,
)

log = get_logger(__name__)

NAME = "train"
LOCAL_REQUEUE = 144  # submitit's local controller restarts the tasks on this exit code


__all__ = ["NAME", "STAGE", "TrainJob", "TrainStage", "run_name", "trainer_config", "write_data_report"]


@dataclass
class TrainJob:
    run_dir: str
    trainer_config: dict[str, Any]
    data_summaries: list[str] = field(default_factory=list)  # preprocessing summaries → data_report.json
    # layout=auto tune=true: the tuning this job's layout comes from (its key, state dir and candidates);
    # the trainer config above is the plan's first choice until the decision replaces its layout.
    tune_key: str | None = None
    tune_dir: str | None = None
    candidates: list[dict[str, Any]] = field(default_factory=list)


def decided_config(job: TrainJob, upstream: list[Upstream], rank: int) -> dict[str, Any]:
    """The trainer config at the layout the tuning decided (orchestrator/stages/tuning.py): the stored
    decision, else the one taken now from the trials that the tune job of this launch (an upstream)
    measured."""
    ran = next((u for u in upstream if u.output_dir == job.tune_dir and u.job_id), None)
    slurm = ran is not None and ran.executor == "slurm"

    def slurm_state(job_id: str) -> str | None:
        return queue.query_slurm([job_id])[1].get(job_id, {}).get("state") if slurm else None

    tcfg = job.trainer_config
    which = tuning.Tuning(job.run_dir, job.candidates, str(job.tune_key), ran.job_id if ran else None)
    table = tuning.decided(which, rank, slurm_state, tcfg["logging"]["wandb"], str(tcfg.get("run_id") or ""))
    if rank == 0:
        log.info("layout=auto: training with %s (table: %s)", tuning.verdict(table),
                 RunDir(job.run_dir).layout_table_text)
    return tuning.apply_winner(tcfg, table)


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
    report = {"skipped_lines": sum(skipped.values()), "skipped": skipped,
              "skipped_examples": [e for s in found for e in s.get("skipped_examples", [])],
              "summaries": found}
    out = RunDir(run_dir).data_report
    write_json(out, report)
    if report["skipped_lines"]:
        log.warning("the run's data dropped %d bad input line(s) (data.on_error=skip); see %s",
                    report["skipped_lines"], out)
    return out


def check_data_tokenizer(summaries: list[str], tokenizer: dict[str, Any]) -> None:
    """The data must have been tokenized by the run's tokenizer (its preprocessing summaries record which:
    trainer.data.tokenizer_identity); a ValueError, not retried, when a file changed in between."""
    refusal = data_refusal(summaries, identify(tokenizer))
    if refusal:
        raise ValueError(refusal)


class TrainStage(NodeStage):
    """Training: one task per device. Exits with the requeue code when the trainer stopped on a signal.

    If USR2 arrives before the trainer installed its own handler, submitit's handler calls
    :meth:`checkpoint`, which resubmits this same callable; the trainer resumes from its latest checkpoint.
    """

    def _fatal_marker(self) -> tuple[str, Path]:
        """(this task's job id, its attempt's fatal marker): a relaunch (new job) never reads an old
        marker, local jobs included."""
        attempt = os.environ.get(ATTEMPT_ENV, "0")
        restart = os.environ.get("SLURM_RESTART_COUNT", "0")
        job_id = job_of_task()
        name = FATAL_MARKER.format(job=job_id, restart=restart, attempt=attempt)
        return job_id, Path(self.output_dir, name)

    def failed(self, err: Exception) -> None:
        """A failure a retry would repeat (trainer.signals.permanent_reason; an upstream output this node
        cannot see among them) leaves the fatal marker: the batch script stops instead of retrying."""
        reason = permanent_reason(err)
        if reason is not None:
            self._fatal_marker()[1].write_text(f"{EXIT_PERMANENT} {reason.splitlines()[0][:2000]}\n")
            log.error("a retry would repeat this failure; not retrying: %s", reason)

    def run(self) -> dict[str, Any]:
        job: TrainJob = self.job
        export_torch_env()
        rank = int(os.environ["RANK"])
        attempt = os.environ.get(ATTEMPT_ENV, "0")
        restart = os.environ.get("SLURM_RESTART_COUNT", "0")
        if faults.plugin() is not None:
            faults.warn_active(log, os.environ)
        faults.at("train:start", run_dir=job.run_dir, rank=rank, restart=restart, attempt=attempt)
        if rank == 0:
            write_data_report(job.data_summaries, job.run_dir)
        config = decided_config(job, self.upstream, rank) if job.candidates else job.trainer_config
        from trainer.run import RunHooks, run

        on_step = faults.hook("train_on_step", self.output_dir, rank)
        hooks = RunHooks(on_step=on_step) if on_step is not None else None
        job_id, marker = self._fatal_marker()
        check_data_tokenizer(job.data_summaries, config.get("tokenizer") or {})
        result = run(RunConfig.from_dict(config), hooks)
        code = int(getattr(result, "exit_code", result) or 0)
        verdict = getattr(result, "reason", "")
        why = f"{verdict} (exit {code})" if verdict else f"the trainer exited with code {code}"
        if code == EXIT_NONFINITE:  # the trainer's one-line verdict: status shows it (and the iteration)
            marker.write_text(f"{EXIT_NONFINITE} {verdict or 'non-finite loss or gradient norm'}\n")
        if code == EXIT_REQUEUE:
            # Local controller requeues on its own code; the sbatch script requeues on the trainer's, or
            # on this marker (every stopping rank writes it, so it exists before the first one exits).
            local = os.environ.get("SUBMITIT_EXECUTOR") == "local"
            Path(self.output_dir, STOPPED_MARKER.format(job=job_id, restart=restart, attempt=attempt)).touch()
            log.warning("trainer stopped for requeue (checkpoint saved); exiting with %s",
                        LOCAL_REQUEUE if local else EXIT_REQUEUE)
            sys.exit(LOCAL_REQUEUE if local else EXIT_REQUEUE)
        if code != 0:
            raise RuntimeError(why)
        return {"checkpoints": job.trainer_config.get("checkpoint", {}).get("dir"), "rank": rank,
                "iteration": getattr(result, "iteration", None)}


class Train(StageDef):
    name = NAME
    after = (preprocess.NAME, tune.NAME)
    node = TrainStage
    stage_job = False

    def plan(self, ctx: PlanContext) -> StagePlan:
        """With tune=true it runs after the trials have ended, whatever their outcome (afterany: a failed
        trial is a result), and takes the layout they decide when it starts."""
        prep, tuned = ctx.planned[preprocess.NAME], ctx.planned.get(tune.NAME)
        tcfg = trainer_config(ctx.cfg, ctx.facts, prep)
        same = {k: v for k, v in tcfg.items() if k not in ("run_dir", "run_id", "logging")}
        key = stable_hash({"trainer": same, "code": ctx.code("trainer"),
                           **({"tune": tuned.key} if tuned else {})})
        job = TrainJob(ctx.facts.run_dir, tcfg, preprocess.summaries(prep.job))
        if tuned is None:
            return StagePlan(NAME, key, str(ctx.run.stage_state(NAME)), False, (preprocess.NAME,), job)
        job.tune_key, job.tune_dir, job.candidates = tuned.key, tuned.state_dir, tuned.job.candidates
        return StagePlan(NAME, key, str(ctx.run.stage_state(NAME)), False, (preprocess.NAME, tune.NAME), job,
                         after_any=(tune.NAME,))

    def resources(self, cfg: SlipwayConfig, tasks_per_node: int) -> JobResources:
        """The GPU layout, the run's time limit, and the requeue/retry policy (signal lead, max retries)."""
        c = cfg.cluster
        return JobResources(NAME, c.nodes, tasks_per_node, c.gpus_per_node, c.cpus_per_task,
                            c.time_limit_min, c.partition, mem=mem_flag(c.mem_gb), exclusive=c.exclusive,
                            signal_delay_s=c.signal_delay_s, max_retries=c.max_retries,
                            max_timeouts=c.max_timeouts, **common_resources(cfg))

    def complete(self, stage: StagePlan) -> str | None:
        """Nothing to train when the checkpoint the job would resume from is at ``train.iters`` already:
        a job would load it and stop (a relaunch that only lacks hf/ or eval/ reruns only those). A
        checkpoint past ``train.iters`` is a plan problem (checks/checkpoints.py)."""
        ck, iters = stage.job.trainer_config["checkpoint"], stage.job.trainer_config["train"]["iters"]
        if ck.get("load") not in (None, "latest"):
            return None
        done = progress.checkpoint_iter(Path(stage.job.run_dir), {"config": {"checkpoint": ck}})
        return f"its checkpoint is at iteration {done} = train.iters: nothing to train" if done == iters \
            else None

    def status(self, look: StageLook) -> dict[str, Any]:
        run_dir, recs = look.run_dir, progress.log_records(look.run_dir, NAME)
        slurm_runs = int(look.accounting.get("records", "1"))
        state_dir = Path(look.entry.get("state_dir", RunDir(run_dir).stage_state(NAME)))
        ranks = read_heartbeats(str(run_dir), stale_after_s=look.stale_after_s)
        check = last_kernel_check(run_dir)
        out: dict[str, Any] = dict(
            restarts=progress.restarts(state_dir, slurm_runs - 1),
            checkpoint_iter=progress.checkpoint_iter(run_dir, look.run),
            wandb=progress.wandb_path(run_dir, look.run), wandb_offline=progress.wandb_offline(run_dir),
            hangs=progress.hangs(run_dir), log=str(RunDir(run_dir).logs), ranks=ranks,
            bad_nodes=progress.bad_nodes(run_dir, state_dir, slurm_runs - 1),
            health="; ".join(x for x in (summarize(ranks), kernel_cell(check)) if x),
            kernel_fallbacks=kernel_fallbacks(check), checkpoint_warnings=read_warnings(str(run_dir)))
        if recs:
            out.update(loss=recs[-1][1], tokens_per_s=recs[-1][2])
        return out


STAGE = Train()
