"""The only module with side effects: run directory, submitit executors, afterok chains, stage reuse.

Slurm jobs use :class:`SlipwaySlurmExecutor`: submitit's executor (pickled callable, job files, results)
with Slipway's own rendered sbatch script (render.py: retry loop, USR2 forwarding, requeue). Local jobs
use submitit's LocalExecutor; they have no scheduler dependencies, so each stage callable waits for its
upstream's completion marker instead (stages.wait_for), which keeps the launch non-blocking there too.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import submitit

from orchestrator import render
from orchestrator.plan import Plan, StagePlan
from orchestrator.schema import SlipwayConfig
from orchestrator.stages import COMPLETE, FAILED, STAGE_CALLABLES, Upstream
from orchestrator.status import ACTIVE
from orchestrator.validate import tasks_per_node
from trainer.log import get_logger

log = get_logger(__name__)
JOB_FILE = "_JOB.json"


class SlipwaySlurmExecutor(submitit.SlurmExecutor):
    """submitit's SlurmExecutor whose batch script is render.render_sbatch's."""

    def __init__(self, folder: str, spec: render.ScriptSpec, python: str) -> None:
        super().__init__(folder, max_num_timeout=spec.resources.max_timeouts, python=python)
        self.spec = spec
        r = spec.resources
        self.update_parameters(nodes=r.nodes, ntasks_per_node=r.tasks_per_node, time=r.time_limit_min)

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return render.render_sbatch(dataclasses.replace(self.spec, command=command))


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
    return os.path.join(stage.state_dir if stage.shared else plan.run_dir, "jobs", stage.name)


def stage_log_dir(plan: Plan, stage: StagePlan) -> str:
    return os.path.join(stage.state_dir, "logs") if stage.shared else os.path.join(plan.run_dir, "logs")


def _abs(p: str) -> str:
    return os.path.abspath(p)


def render_stage(
    cfg: SlipwayConfig, plan: Plan, stage: StagePlan, deps: tuple[str, ...] = (), python: str | None = None
) -> str:
    """The script (Slurm) or parameter record (local) for one stage, as it would be submitted."""
    res = render.stage_resources(stage.name, cfg.cluster, cfg.experiment, tasks_per_node(cfg))
    py = python or render.python_command(
        cfg.container, _abs(os.path.join(plan.run_dir, "container_exec.sh")), sys.executable
    )
    folder = _abs(stage_folder(plan, stage))
    command = job_command(py, folder)
    env = tuple(sorted(cfg.cluster.env.items()))
    if cfg.cluster.executor == "local":
        return render.render_local(render.LocalSpec(res, command, folder, stage.name, env))
    spec = render.ScriptSpec(
        res,
        command,
        _abs(stage_log_dir(plan, stage)),
        stage.name,
        plan.run_id,
        _abs(stage.state_dir),
        deps,
        env,
        tuple(cfg.cluster.setup),
    )
    return render.render_sbatch(spec)


def container_wrapper(cfg: SlipwayConfig, plan: Plan) -> str | None:
    if cfg.container.kind != "apptainer":
        return None
    binds = [_abs(cfg.runs_root), _abs(cfg.cache_dir or os.path.join(cfg.runs_root, "_cache"))]
    binds += [_abs(os.path.dirname(p)) for p in [*cfg.data.paths, cfg.tokenizer.vocab_file or ""] if p]
    code = str(Path(__file__).resolve().parent.parent)
    image = _abs(cfg.container.image) if cfg.container.image else None
    container = dataclasses.replace(cfg.container, image=image)
    return render.render_container_wrapper(container, binds, code, cfg.cluster.gpus_per_node > 0)


def slurm_job_active(job_id: str) -> bool:
    out = subprocess.run(
        ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=60
    )
    return out.returncode == 0 and out.stdout.strip() in ACTIVE


def _local_active(job_id: str) -> bool:
    try:
        os.kill(int(job_id), 0)
        return True
    except (OSError, ValueError):
        return False


def _queued(stage: StagePlan) -> dict[str, Any] | None:
    """The job already producing this shared output, if it is still queued or running."""
    path = Path(stage.state_dir) / JOB_FILE
    if not path.exists():
        return None
    import json

    info = json.loads(path.read_text())
    active = _local_active if info.get("executor") == "local" else slurm_job_active
    return info if active(str(info["job_id"])) else None


def _executor(cfg: SlipwayConfig, plan: Plan, stage: StagePlan, deps: tuple[str, ...]) -> Any:
    res = render.stage_resources(stage.name, cfg.cluster, cfg.experiment, tasks_per_node(cfg))
    py = render.python_command(
        cfg.container, _abs(os.path.join(plan.run_dir, "container_exec.sh")), sys.executable
    )
    folder = _abs(stage_folder(plan, stage))
    if cfg.cluster.executor == "local":
        ex = submitit.LocalExecutor(folder, python=py)
        setup = [f"export {k}={render.shlex.quote(v)}" for k, v in sorted(cfg.cluster.env.items())]
        spec = render.LocalSpec(res, job_command(py, folder), folder, stage.name)
        ex.update_parameters(setup=setup, **render.local_parameters(spec))
        return ex
    spec = render.ScriptSpec(
        res,
        "",
        _abs(stage_log_dir(plan, stage)),
        stage.name,
        plan.run_id,
        _abs(stage.state_dir),
        deps,
        tuple(sorted(cfg.cluster.env.items())),
        tuple(cfg.cluster.setup),
    )
    return SlipwaySlurmExecutor(folder, spec, py)


def submit_plan(cfg: SlipwayConfig, plan: Plan) -> list[Submitted]:
    """Submit the stage graph in order; shared stages are reused or depended on when possible."""
    import json

    from orchestrator.runs import record_job

    done: dict[str, Submitted] = {}
    local = cfg.cluster.executor == "local"
    for stage in plan.stages:
        Path(stage.state_dir).mkdir(parents=True, exist_ok=True)
        # Slurm fails a job at once (no log anywhere) when its --output directory does not exist.
        Path(stage_log_dir(plan, stage)).mkdir(parents=True, exist_ok=True)
        if stage.shared and (Path(stage.state_dir) / COMPLETE).exists():
            done[stage.name] = Submitted(stage.name, "reused", executor=cfg.cluster.executor)
            log.info("%s: reusing complete output %s", stage.name, stage.state_dir)
            continue
        queued = _queued(stage) if stage.shared else None
        if queued is not None:
            done[stage.name] = Submitted(
                stage.name, "depends-on-queued", str(queued["job_id"]), queued.get("executor", "slurm")
            )
            log.info("%s: same key already queued as job %s; depending on it", stage.name, queued["job_id"])
            continue
        ups = [done[d] for d in stage.depends_on if d in done]
        deps = tuple(u.job_id for u in ups if u.job_id and u.executor == "slurm")
        upstream = [Upstream(_abs(plan.stage(u.stage).state_dir), u.job_id, u.executor) for u in ups]
        (Path(stage.state_dir) / FAILED).unlink(missing_ok=True)
        timeout = cfg.cluster.time_limit_min * 60.0 * 4 if local else 300.0
        fn = STAGE_CALLABLES[stage.name](stage.job, _abs(stage.state_dir), upstream, stage.key, timeout)
        ex = _executor(cfg, plan, stage, deps)
        job = ex.submit(fn)
        script = (
            None
            if local
            else render.render_sbatch(
                dataclasses.replace(ex.spec, command=job_command(ex.python, _abs(stage_folder(plan, stage))))
            )
        )
        sub = Submitted(stage.name, "submitted", str(job.job_id), cfg.cluster.executor, script, job)
        done[stage.name] = sub
        entry = {
            "job_id": sub.job_id,
            "executor": sub.executor,
            "key": stage.key,
            "depends_on": list(deps),
            "folder": stage_folder(plan, stage),
            "state_dir": stage.state_dir,
        }
        if stage.shared:
            (Path(stage.state_dir) / JOB_FILE).write_text(json.dumps(entry))
        record_job(plan.run_dir, stage.name, entry)
        if script:
            path = Path(plan.run_dir) / "scripts" / f"{stage.name}.sbatch"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(script)
        log.info(
            "%s: submitted job %s%s", stage.name, sub.job_id, f" (afterok:{':'.join(deps)})" if deps else ""
        )
    return list(done.values())
