"""The tune stage (layout=auto tune=true): short trial jobs of the plan's best-ranked layouts
(orchestrator/planning/autolayout.py), after preprocessing — they train on the run's own data — and before
training, which takes the fastest (orchestrator/stages/tuning.py decides when the train job starts).

On Slurm the trials are one job array, ``--array=0-K-1%C`` (``autotune.candidates``,
``autotune.concurrency``), each element one trial on the run's own allocation shape (nodes, tasks, GPUs),
no requeue; training waits for the whole array with ``afterany``, since a trial that fails is a result.
On the local executor one job runs the trials one after another (orchestrator/stages/trials.py). The
outputs are the trials' records in ``<run_dir>/tune/``; the stage is complete while a decision for the
same tuning exists, so a relaunch trains with it instead of tuning again (tune=force measures again).
``status`` shows how many trials measured, why the others failed, and the decision.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any

from orchestrator.base.plan_types import JobResources, StagePlan
from orchestrator.base.schema import SlipwayConfig
from orchestrator.render import mem_flag
from orchestrator.stages import preprocess
from orchestrator.stages.base import (
    NodeStage,
    PlanContext,
    StageDef,
    StageLook,
    common_resources,
    job_of_task,
    stable_hash,
    wait_for,
)
from orchestrator.stages.trainer_job import export_torch_env, trainer_config
from orchestrator.stages.trials import (
    FAILED,
    MEASURED,
    TrialSpec,
    begin,
    read_json,
    run_local,
    run_rank,
    trial_config,
)
from orchestrator.stages.tuning import outcomes_so_far, stored, verdict
from orchestrator.world import queue
from trainer.run_files import RunDir

NAME = "tune"


@dataclass
class TuneJob:
    run_dir: str
    key: str
    trials: list[TrialSpec]
    candidates: list[dict[str, Any]]  # index, name, overrides, the plan's estimate (the table's rows)
    world: int
    limit_s: float  # one trial's time limit (the local executor enforces it itself)
    force: bool = False  # tune=force: measure although a decision for this tuning exists
    wandb: dict[str, Any] = field(default_factory=dict)


class TuneStage(NodeStage):
    """Local: every trial in turn (the stage's markers as every stage's). Slurm: one array element's
    rank of one trial (:meth:`array_task`); its outcome is the trial's record, not the stage's marker."""

    index: int | None = None

    def array_task(self, index: int) -> TuneStage:
        task = copy.copy(self)
        task.index = index
        return task

    def __call__(self) -> Any:
        if self.index is None:
            return super().__call__()
        wait_for(self.upstream, self.upstream_timeout_s)
        export_torch_env()
        spec, job = self.job.trials[self.index], job_of_task()
        if os.environ.get("RANK") == "0":
            begin(spec, job)
        run_rank(spec, job)
        return {"trial": self.index}

    def run(self) -> dict[str, Any]:
        job: TuneJob = self.job
        return {"trials": run_local(job.trials, job.world, job_of_task(), job.limit_s)}

    def checkpoint(self, *args: Any, **kwargs: Any) -> None:
        """A trial is not requeued: stopped or timed out, it is a result (the decision reads why)."""
        return None


def _estimate(p: Any, r: Any, seq: int) -> dict[str, Any]:
    step = r.time.step_s if r.time.known else None
    return {"step_s": step, "tokens_per_s": p.global_batch * seq / step if step else None,
            "memory_bytes": r.memory.total_bytes}


def _speed_inputs(cfg: SlipwayConfig, base: dict[str, Any], p: Any) -> dict[str, Any]:
    """What the trials' speed depends on besides the candidates: a decision is reused while these hold."""
    a, c = cfg.autotune, cfg.cluster
    return {"model": base["model"], "tokenizer": base["tokenizer"], "kernels": base["kernels"],
            "precision": base["train"]["precision"], "optim_impl": base["optim"]["impl"],
            "global_batch": p.global_batch, "world": [p.nodes, p.tasks_per_node, c.gpus_per_node],
            "device": c.device_name, "trial": [a.warmup_iters, a.iters, a.log_interval]}


class Tune(StageDef):
    name = NAME
    after = (preprocess.NAME,)
    node = TuneStage
    stage_job = False

    def plan(self, ctx: PlanContext) -> StagePlan | None:
        cfg, p, a = ctx.cfg, ctx.proposal, ctx.cfg.autotune
        if cfg.layout != "auto" or cfg.tune == "false" or p is None or len(p.ranked) < 2:
            return None  # nothing to measure (a single layout that fits is taken as it is)
        prep, run_dir = ctx.planned[preprocess.NAME], ctx.facts.run_dir
        base = trainer_config(cfg, ctx.facts, prep)
        candidates = [{"index": i, "name": r.candidate.name, "overrides": r.candidate.overrides(),
                       "estimate": _estimate(p, r, cfg.model.seq_length)}
                      for i, r in enumerate(p.trials(a.candidates))]
        key = stable_hash({**_speed_inputs(cfg, base, p), "candidates": [c["overrides"] for c in candidates],
                           "code": ctx.code("trainer")})
        trials = [TrialSpec(run_dir, c["index"], c["name"], c["overrides"],
                            trial_config(base, c["overrides"], run_dir, c["index"], a), a.warmup_iters,
                            a.warmup_iters + a.iters, key) for c in candidates]
        job = TuneJob(run_dir, key, trials, candidates, p.world, a.time_limit_min * 60.0, cfg.tune == "force",
                      base["logging"]["wandb"])
        return StagePlan(NAME, key, str(ctx.run.stage_state(NAME)), False, (preprocess.NAME,), job,
                         array=(len(trials), a.concurrency))

    def resources(self, cfg: SlipwayConfig, tasks_per_node: int) -> JobResources:
        """Slurm: each array element has the training job's shape for autotune.time_limit_min. Local: one
        controller, whose trials' ranks are its processes, one trial at a time."""
        c, a = cfg.cluster, cfg.autotune
        if c.executor == "local":
            return JobResources(NAME, 1, 1, c.gpus_per_node, c.cpus_per_task,
                                a.time_limit_min * a.candidates + 5, c.partition, **common_resources(cfg))
        return JobResources(NAME, c.nodes, tasks_per_node, c.gpus_per_node, c.cpus_per_task,
                            a.time_limit_min, c.partition, mem=mem_flag(c.mem_gb), exclusive=c.exclusive,
                            **common_resources(cfg))

    def complete(self, stage: StagePlan) -> str | None:
        """Nothing to measure while a decision for this tuning exists (unless tune=force)."""
        job: TuneJob = stage.job
        table = None if job.force else stored(job.run_dir, job.key, None)
        return None if table is None else f"decided already: {verdict(table)} ({RunDir(job.run_dir).tune})"

    def status(self, look: StageLook) -> dict[str, Any]:
        """The trials' count and failures (and the decision, once training took it). A trial that failed
        is a result: the stage completed once the trials ended with one measured."""
        run, job = RunDir(look.run_dir), str(look.entry["job_id"])
        table = read_json(run.layout_table)
        if table is not None and str(table.get("tune_job")) == job:
            failed = [f"{r['name']} {r['status']}: {r['reason']}" for r in table["rows"]
                      if r["status"] != MEASURED]
            return {"note": "; ".join([f"decision: {verdict(table)}", *failed]),
                    **({"state": "COMPLETED", "failure": ""} if queue.ended(look.state) else {})}
        rows = outcomes_so_far(str(look.run_dir), job)
        measured = [r for r in rows if r["status"] == MEASURED]
        note = f"{len(measured)} of {len(rows)} trial(s) started measured" + "".join(
            f"; {r['name']} {r['status']}: {r['reason']}" for r in rows if r["status"] == FAILED)
        done = queue.ended(look.state) and measured
        return {"note": note, **({"state": "COMPLETED", "failure": ""} if done else {})}


STAGE = Tune()
