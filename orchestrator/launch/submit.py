"""Submission: submitit executors, afterok chains, stage reuse — the layer that talks to the scheduler.

Side effects are not all here. The launch's are spread over modules named for them: this one submits
jobs and writes each job's record (``_JOB.json``, the launch's intents and jobs through launches.py,
``launches/<n>/scripts/``); runs.py writes the run directory and sweep manifests and reads git and file
stats; writer_lock.py takes the launch locks
and writes the checkpoint directory's writer record; queue.py asks squeue/sacct and local processes;
flow.py records the run (config, scripts) and waits; each stage's node callable (stages/) runs on the
nodes. Planning (plan.py, the pure checks in checks/, estimate.py) and rendering (render.py) are pure.

Slurm jobs use :class:`SlipwaySlurmExecutor`: submitit's executor (pickled callable, job files, results)
with Slipway's own rendered sbatch script (render.py: retry loop, USR2 forwarding, requeue). Local jobs
use submitit's LocalExecutor; they have no scheduler dependencies, so each stage callable waits for its
upstream's completion marker instead (stages/upstream.py wait_for), which keeps the launch non-blocking
there too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import submitit
from submitit.core.utils import DelayedSubmission, FailedJobError, JobPaths
from submitit.slurm.slurm import SlurmJob

from orchestrator import container_render, render
from orchestrator.base.layout import tasks_per_node
from orchestrator.base.plan_types import Plan, StagePlan
from orchestrator.base.schema import ContainerConfig, SlipwayConfig
from orchestrator.record.launches import LaunchRecord, job_comment, launch_dir
from orchestrator.stages import get as stage_def
from orchestrator.stages import preprocess
from orchestrator.stages.base import StageDef, job_name
from orchestrator.stages.upstream import Upstream
from orchestrator.world.container import WRAPPER_KINDS, host_paths, job_image
from orchestrator.world.local_jobs import LocalExecutor
from orchestrator.world.queue import live_state
from orchestrator.world.runs import REPO_ROOT
from trainer import faults
from trainer.log import get_logger
from trainer.run_files import COMPLETE, FAILED, JOB_RECORD, JOBS, LOGS, RunDir

log = get_logger(__name__)


class SubmitError(RuntimeError):
    """``sbatch`` refused a stage's job: which, why (Slurm's words), and what this launch submitted before."""

    def __init__(self, stage: str, before: list[str], run_dir: str, why: str) -> None:
        lines = [x for x in why.strip().splitlines() if x.strip()] or ["(no message)"]
        earlier = (f"; the stages submitted before it ({', '.join(before)}) stay queued: see python -m "
                   f"orchestrator status {run_dir}, or cancel them: python -m orchestrator cancel {run_dir}"
                   if before else "; nothing was submitted")
        super().__init__(f"sbatch refused the {stage} job: {lines[-1]}{earlier}. Fix the cluster settings it "
                         "names (cluster.partition, account, qos, constraint, sbatch_extra) and launch again")


class SlipwaySlurmExecutor(submitit.SlurmExecutor):
    """submitit's SlurmExecutor whose batch script is render.render_sbatch's."""

    def __init__(self, folder: str, spec: render.ScriptSpec, python: str) -> None:
        super().__init__(folder, max_num_timeout=spec.resources.max_timeouts, python=python)
        self.spec = spec
        self.script: str | None = None  # the script as submitted (recorded in the run directory)
        r = spec.resources
        self.update_parameters(nodes=r.nodes, ntasks_per_node=r.tasks_per_node, time=r.time_limit_min)

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        # submitit's command is job_command(python, folder) again; render with exactly what it submits.
        self.script = render.render_sbatch(dataclasses.replace(self.spec, command=command))
        return self.script

    def submit_array(self, fns: list[Any]) -> list[SlurmJob]:
        """One sbatch of the job array the spec names (its ``--array``), element ``i`` running ``fns[i]``:
        submitit's own array submission, which would render submitit's script instead of ours."""
        folder = JobPaths.get_first_id_independent_folder(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        pickles = []
        for i, fn in enumerate(fns):
            delayed = DelayedSubmission(fn)
            delayed.set_timeout(self.spec.resources.time_limit_min, self.max_num_timeout)
            pickles.append(folder / f"array_{os.getpid()}_{i}.pkl")
            delayed.dump(pickles[-1])
        first = self._submit_command(self._submitit_command_str)
        jobs = [SlurmJob(folder=self.folder, job_id=f"{first.job_id}_{i}", tasks=list(range(first.num_tasks)))
                for i in range(len(fns))]
        for job, path in zip(jobs, pickles, strict=True):  # each element waits for its pickle (submitit)
            job.paths.move_temporary_file(path, "submitted_pickle")
        return jobs


@dataclass
class Submitted:
    """One stage's outcome in this launch."""

    stage: str
    action: str  # submitted | reused | depends-on-queued
    job_id: str | None = None
    executor: str = "slurm"
    script: str | None = None
    job: Any = field(default=None, repr=False)  # the submitit Job (this process only)


def job_command(python: str, folder: str) -> str:
    """``python`` is already a shell word sequence (render.python_command quotes it); the folder is quoted
    here, so a path with spaces or non-ASCII characters stays one argument."""
    return f"{python} -u -m submitit.core._submit {shlex.quote(folder)}"


def stage_folder(plan: Plan, stage: StagePlan) -> str:
    if stage.shared:  # a shared stage's jobs live beside its output, where every run finds them
        return os.path.join(stage.state_dir, JOBS, stage.name)
    return str(RunDir(plan.run_dir).jobs(stage.name))


def stage_log_dir(plan: Plan, stage: StagePlan) -> str:
    return os.path.join(stage.state_dir, LOGS) if stage.shared else str(RunDir(plan.run_dir).logs)


def _definition(stage: StagePlan) -> StageDef:
    return _definition_named(stage.name)


def _definition_named(name: str) -> StageDef:
    found = stage_def(name)
    if found is None:  # a plan holds only registered stages; this is a plugin unregistered since
        raise KeyError(f"no stage named {name!r} is registered (orchestrator/stages/)")
    return found


def _abs(p: str) -> str:
    return os.path.abspath(p)


@dataclass(frozen=True)
class After:
    """The upstream job ids a job runs after: once they succeeded (afterok), once they ended (afterany)."""

    ok: tuple[str, ...] = ()
    ended: tuple[str, ...] = ()


@dataclass(frozen=True)
class StageJob:
    """One stage's job description, built once: what the dry run prints and what submit hands submitit."""

    python: str  # the shell words that start Python (maybe inside the container)
    folder: str  # submitit's job folder
    spec: render.ScriptSpec | render.LocalSpec


def stage_job(
    cfg: SlipwayConfig, plan: Plan, stage: StagePlan, deps: tuple[str, ...] | After = (),
    python: str | None = None, launch_n: int = 1,
) -> StageJob:
    """The one builder of a stage's job spec (Slurm: the sbatch script's; local: the executor's).
    ``launch_n``: the launch that submits it (the run's next one: LaunchRecord), named in the job's comment.
    ``deps``: the upstream job ids it runs after (afterok), or an :class:`After` (afterok and afterany)."""
    after = deps if isinstance(deps, After) else After(tuple(deps))
    res = _definition(stage).resources(cfg, tasks_per_node(cfg))
    res = dataclasses.replace(res, name=job_name(cfg.experiment, plan.run_id, stage.name))
    if stage.array is not None and cfg.cluster.executor != "local":
        n, at_once = stage.array
        res = dataclasses.replace(res, array=f"0-{n - 1}%{min(at_once, n)}")
    py = python or container_render.python_command(
        cfg.container, _abs(os.path.join(plan.run_dir, "container_exec.sh")), sys.executable,
        gpus=res.gpus_per_node > 0,
    )
    folder = _abs(stage_folder(plan, stage))
    command = job_command(py, folder)
    env = tuple(sorted(cfg.cluster.env.items()))
    if cfg.cluster.executor == "local":
        return StageJob(py, folder, render.LocalSpec(res, command, folder, stage.name, env))
    spec = render.ScriptSpec(
        res,
        command,
        _abs(stage_log_dir(plan, stage)),
        stage.name,
        plan.run_id,
        _abs(stage.state_dir),
        after.ok,
        after.ended,
        env,
        tuple(cfg.cluster.setup),
        pyxis=pyxis_spec(cfg),
        comment=job_comment(plan.run_dir, launch_n, stage.name),
        code_dir=str(REPO_ROOT),
        run_dir=_abs(plan.run_dir),
        helper=_helper_flags(cfg),
    )
    return StageJob(py, folder, spec)


def _helper_flags(cfg: SlipwayConfig) -> tuple[tuple[str, str], ...]:
    """Where the training job's one-CPU node-exclusion helper runs (render.py): where the CPU-only data
    stages run, with the same account and QoS."""
    cpu = _definition_named(preprocess.NAME).resources(cfg, 1)
    return tuple((k, str(v)) for k, v in (("partition", cpu.partition), ("account", cpu.account),
                                           ("qos", cpu.qos)) if v not in (None, ""))


def render_stage(
    cfg: SlipwayConfig, plan: Plan, stage: StagePlan, deps: tuple[str, ...] | After = (),
    python: str | None = None, launch_n: int = 1,
) -> str:
    """The script (Slurm) or parameter record (local) for one stage, as it would be submitted."""
    job = stage_job(cfg, plan, stage, deps, python, launch_n)
    if isinstance(job.spec, render.LocalSpec):
        return render.render_local(job.spec)
    return render.render_sbatch(job.spec)


def _container(cfg: SlipwayConfig) -> tuple[ContainerConfig, list[str]]:
    """The container section with the image as jobs name it, and the job's folders to bind or mount."""
    container = dataclasses.replace(cfg.container, image=job_image(cfg.container),
                                    binds=[_abs(b) for b in cfg.container.binds])
    return container, [path for _, path in host_paths(cfg)]


def container_wrapper(cfg: SlipwayConfig, plan: Plan) -> str | None:
    """Apptainer and Charliecloud: the per-task wrapper (charliecloud's working directory is the launch
    directory, where sbatch starts the job)."""
    if cfg.container.kind not in WRAPPER_KINDS:
        return None
    container, binds = _container(cfg)
    return container_render.render_container_wrapper(container, binds, str(REPO_ROOT), os.getcwd(),
                                                     tuple(sorted(cfg.cluster.env)))


def pyxis_spec(cfg: SlipwayConfig) -> container_render.PyxisSpec | None:
    """container.kind=pyxis: the srun container flags. The job starts in the launch directory (sbatch
    runs it where it was submitted), so that is the container's working directory too."""
    if cfg.container.kind != "pyxis":
        return None
    container, binds = _container(cfg)
    return container_render.PyxisSpec(container, tuple(binds), str(REPO_ROOT), os.getcwd(),
                                      tuple(sorted(cfg.cluster.env)))


def _queued(stage: StagePlan) -> dict[str, Any] | None:
    """The job already producing this shared output, if it is still queued or running."""
    path = Path(stage.state_dir) / JOB_RECORD
    if not path.exists():
        return None
    info = json.loads(path.read_text())
    state = live_state(str(info["job_id"]), info.get("executor", "slurm"), info.get("folder"))
    return info if state else None


def _executor(job: StageJob) -> Any:
    if isinstance(job.spec, render.LocalSpec):
        ex = LocalExecutor(job.folder, python=job.python)
        env = [f"export {k}={shlex.quote(v)}" for k, v in job.spec.env]
        setup = [render.code_path_line(str(REPO_ROOT)), *env]
        ex.update_parameters(setup=setup, **render.local_parameters(job.spec))
        return ex
    return SlipwaySlurmExecutor(job.folder, job.spec, job.python)


def _upstream(plan: Plan, stage: StagePlan, done: dict[str, Submitted]
              ) -> tuple[tuple[str, ...], tuple[str, ...], list[Upstream]]:
    """(afterok ids, afterany ids, what the node callable waits for). A reused upstream is complete
    already; every other is waited for by its job id: Slurm's afterok (afterany for ``stage.after_any``),
    and the same rule for local jobs (stages/upstream.py wait_for: only that job's marker counts)."""
    ups = [done[d] for d in stage.depends_on if d in done and done[d].action != "reused"]
    slurm = [(u.job_id, u.stage in stage.after_any) for u in ups if u.job_id and u.executor == "slurm"]
    upstream = [Upstream(_abs(plan.stage(u.stage).state_dir), u.job_id, u.executor,
                         u.stage in stage.after_any) for u in ups]
    return (tuple(j for j, anyhow in slurm if not anyhow), tuple(j for j, anyhow in slurm if anyhow),
            upstream)


def _submit_job(ex: Any, fn: Any, stage: StagePlan, local: bool) -> tuple[Any, str]:
    """(the submitit job, the id recorded): one job, or on Slurm one array recorded under its array id
    (scancel, squeue and sacct take it for all its elements)."""
    if stage.array is not None and not local:
        job = ex.submit_array([fn.array_task(i) for i in range(stage.array[0])])[0]
        return job, str(job.job_id).split("_")[0]
    job = ex.submit(fn)
    return job, str(job.job_id)


def _record(plan: Plan, record: LaunchRecord, stage: StagePlan, sub: Submitted,
            deps: tuple[tuple[str, ...], tuple[str, ...], list[Upstream]], comment: str) -> None:
    """The job's record (run.json, a shared stage's _JOB.json) and script; ``deps``: (afterok, afterany,
    the upstream its callable waits for: the local ones are recorded, so that status shows the job
    PENDING (Dependency) while it waits, as Slurm does: queue.local_state)."""
    local = [{"job_id": u.job_id, "state_dir": u.output_dir, "after_any": u.after_any}
             for u in deps[2] if u.executor == "local" and u.job_id]
    entry = {
        "job_id": sub.job_id,
        "executor": sub.executor,
        "key": stage.key,
        "depends_on": [*deps[0], *deps[1]],
        **({"waits_for": local} if local else {}),
        "folder": stage_folder(plan, stage),
        "state_dir": stage.state_dir,
        "log_dir": _abs(stage_log_dir(plan, stage)),  # Slurm's job logs (orchestrator/readback/logs.py)
        **({"comment": comment} if comment else {}),
    }
    if stage.shared:
        (Path(stage.state_dir) / JOB_RECORD).write_text(json.dumps(entry))
    record.record_job(record.n, stage.name, entry)
    if sub.script:
        path = launch_dir(plan.run_dir, record.n) / "scripts" / f"{stage.name}.sbatch"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(sub.script)
    kinds = zip(("afterok", "afterany"), deps[:2], strict=True)
    after = ",".join(f"{kind}:{':'.join(ids)}" for kind, ids in kinds if ids)
    log.info("%s: submitted job %s%s", stage.name, sub.job_id, f" ({after})" if after else "")


def submit_plan(cfg: SlipwayConfig, plan: Plan, record: LaunchRecord) -> list[Submitted]:
    """Submit the stage graph in order for the launch ``record`` has begun (launches.py); shared
    stages are reused or depended on when possible. Each submission is recorded as an intent before
    ``sbatch`` and as a job id after it (crash consistency: launches.py)."""
    done: dict[str, Submitted] = {}
    local = cfg.cluster.executor == "local"
    for stage in plan.stages:
        Path(stage.state_dir).mkdir(parents=True, exist_ok=True)
        # Slurm fails a job at once (no log anywhere) when its --output directory does not exist.
        Path(stage_log_dir(plan, stage)).mkdir(parents=True, exist_ok=True)
        why = _definition(stage).complete(stage)
        if why is not None:
            done[stage.name] = Submitted(stage.name, "reused", executor=cfg.cluster.executor)
            log.info("%s: not submitted: %s", stage.name, why)
            continue
        queued = _queued(stage) if stage.shared else None
        if queued is not None:
            done[stage.name] = Submitted(
                stage.name, "depends-on-queued", str(queued["job_id"]), queued.get("executor", "slurm")
            )
            log.info("%s: same key already queued as job %s; depending on it", stage.name, queued["job_id"])
            continue
        deps, deps_any, upstream = _upstream(plan, stage, done)
        for marker in (FAILED, COMPLETE):  # an earlier job's outcome is not this one's (status, summary)
            (Path(stage.state_dir) / marker).unlink(missing_ok=True)
        timeout = cfg.cluster.time_limit_min * 60.0 * 4 if local else 300.0
        fn = _definition(stage).node(stage.job, _abs(stage.state_dir), upstream, stage.key, timeout)
        job_spec = stage_job(cfg, plan, stage, After(deps, deps_any), launch_n=record.n)
        ex = _executor(job_spec)
        comment = getattr(job_spec.spec, "comment", "")
        record.record_intent(record.n, stage.name, comment)
        faults.at(f"launch:before_sbatch:{stage.name}")
        try:
            job, job_id = _submit_job(ex, fn, stage, local)
        except FailedJobError as err:  # sbatch said no: its own words are the message
            raise SubmitError(stage.name, [d.stage for d in done.values() if d.action == "submitted"],
                              plan.run_dir, str(err)) from err
        faults.at(f"launch:after_sbatch:{stage.name}")
        script = getattr(ex, "script", None)  # Slurm: the text submitit wrote and sbatch got
        sub = Submitted(stage.name, "submitted", job_id, cfg.cluster.executor, script, job)
        done[stage.name] = sub
        _record(plan, record, stage, sub, (deps, deps_any, upstream), comment)
        faults.at(f"launch:after_record:{stage.name}")
    return list(done.values())
