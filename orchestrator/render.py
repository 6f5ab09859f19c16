"""plan → job scripts: sbatch text, local-executor parameters, the Apptainer wrapper and the pyxis srun
flags (pure, golden-tested).

The sbatch script is Slipway's own (submitit still pickles the callable, names the job files and reads the
results; see submit.py): submitit's template runs one ``srun`` and cannot retry a crashed step or forward a
batch-level USR2. Ours:

- ``--signal=USR2@<lead>`` signals every task before the time limit; a USR2 sent to the batch shell only
  (``scancel --signal=USR2 --batch``) is trapped and forwarded to the step, so both paths reach the trainer.
- The trainer saves and exits 75 (``EXIT_REQUEUE``); the script then requeues the job (``scontrol requeue``,
  same job id, so ``afterok`` dependants keep waiting). A stop near the time limit counts against
  ``max_timeouts``; any other stop is a preemption and is requeued without limit.
- Any other non-zero step exit is a crash: the step is retried in the same allocation up to
  ``max_retries`` times; the trainer resumes from its last complete checkpoint.
- A node the preflight or the hang watchdog named in the failed attempt (``<run_dir>/bad_nodes/``,
  trainer/health/badnodes.py) is not retried into. A retried step cannot leave a node of its allocation,
  and Slurm refuses to change a running job's ``ExcNodeList`` ("Job is no longer pending execution"), so
  the job is requeued *held* (``scontrol requeuehold``: same job id, ``afterok`` dependants keep waiting)
  and a one-CPU helper job, submitted just before, sets ``ExcNodeList`` (the job's own plus the named
  nodes) on the held job and releases it: the next allocation avoids the node. When the partition would
  keep fewer usable nodes than the job needs, the node is kept and the step is retried here instead.
  Each decision is a line of the stage's ``exclusions`` file (``status`` shows it). A failure a retry would
  repeat (a non-finite loss, a full disk, corrupt data, no usable checkpoint, a bad value: see
  ``trainer.signals.permanent_reason``) leaves a ``fatal_<job>_r<restart>_a<attempt>`` marker and is
  not retried.
- ``srun --kill-on-bad-exit=1`` ends all ranks when one dies, instead of the others hanging in a collective.
- ``srun --cpus-per-task=N`` on every step: since Slurm 22.05 srun no longer takes the allocation's
  ``--cpus-per-task`` (SLURM_CPUS_PER_TASK), so where tasks are bound (task/affinity, task/cgroup) each rank,
  and the preprocessing workers, would run on one core.
- Log names carry the restart count and the attempt: ``train_<jobid>_r<restart>_a<attempt>_<task>.out``.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from orchestrator.base.plan_types import JobResources
from orchestrator.base.redaction import is_secret_name
from orchestrator.container_render import PyxisSpec, pyxis_preamble, pyxis_srun_flags
from trainer.formulas import PORT_BASE, PORT_SPAN
from trainer.run_files import (
    ALLOC_START_ENV,
    ATTEMPT_ENV,
    BAD_NODES_DIR,
    BAD_NODES_MARKER,
    EXCLUSIONS,
    FATAL_MARKER,
    REQUEUES,
    RETRIES,
    STOPPED_MARKER,
)
from trainer.signals import EXIT_REQUEUE


def job_tag(r: JobResources) -> str:
    """The job's part of its log names: Slurm's job id, or an array element's array id and index."""
    return "%A_%a" if r.array else "%j"


def mem_flag(mem_gb: float | None) -> str | None:
    """``cluster.mem_gb`` as sbatch's ``--mem`` value (``0`` means all of a node's memory)."""
    if mem_gb is None:
        return None
    return str(int(mem_gb)) + ("G" if mem_gb else "") if mem_gb == int(mem_gb) else f"{int(mem_gb * 1024)}M"


@dataclass(frozen=True)
class ScriptSpec:
    """Everything one sbatch script depends on."""

    resources: JobResources
    command: str  # the per-task command (python -u -m submitit.core._submit FOLDER, maybe containerised)
    log_dir: str
    stage: str
    run_id: str
    state_dir: str  # where the requeue/timeout counters live
    dependency: tuple[str, ...] = ()  # job ids this job runs after (afterok)
    dependency_any: tuple[str, ...] = ()  # job ids this job runs after whatever their outcome (afterany)
    env: tuple[tuple[str, str], ...] = ()
    setup: tuple[str, ...] = ()
    master_port_base: int = PORT_BASE
    pyxis: PyxisSpec | None = None  # container.kind=pyxis: each srun runs its tasks in the image
    comment: str = ""  # --comment: the run, launch and stage (orchestrator/record/launches.py job_comment)
    code_dir: str = ""  # the repository that was launched: first on PYTHONPATH (containers put it there too)
    run_dir: str = ""  # training: where the trainer names bad nodes (empty: no node exclusion)
    helper: tuple[tuple[str, str], ...] = ()  # the exclusion helper job's sbatch flags (partition, account)


def code_path_line(code_dir: str) -> str:
    """Jobs run the code that was launched, not whichever copy of Slipway the job's Python would import
    (an editable install follows the clone that was installed last; ``python -m`` puts the job's working
    directory first, which is wherever the user launched from)."""
    return f'export PYTHONPATH={shlex.quote(code_dir)}${{PYTHONPATH:+:$PYTHONPATH}}'


def sbatch_directives(spec: ScriptSpec) -> list[str]:
    r = spec.resources
    d: list[tuple[str, object]] = [
        ("job-name", r.name),
        ("nodes", r.nodes),
        ("ntasks-per-node", r.tasks_per_node),
    ]
    if r.array:
        d.append(("array", r.array))
    if spec.comment:
        d.append(("comment", spec.comment))
    if r.gpus_per_node:
        d.append(("gpus-per-node", r.gpus_per_node))
    d += [("cpus-per-task", r.cpus_per_task), ("time", r.time_limit_min)]
    for key, value in (
        ("partition", r.partition),
        ("account", r.account),
        ("qos", r.qos),
        ("mem", r.mem),
        ("constraint", r.constraint),
    ):
        if value not in (None, ""):
            d.append((key, value))
    if r.exclusive:
        d.append(("exclusive", True))
    if r.signal_delay_s is not None:
        d += [("signal", f"USR2@{r.signal_delay_s}"), ("requeue", True)]
    else:
        d.append(("no-requeue", True))
    deps = [f"{kind}:" + ":".join(ids) for kind, ids in (("afterok", spec.dependency),
                                                          ("afterany", spec.dependency_any)) if ids]
    if deps:
        # kill-on-invalid-dep: a failed upstream removes this job instead of leaving it pending forever.
        d += [("dependency", ",".join(deps)), ("kill-on-invalid-dep", "yes")]
    d += [("open-mode", "append"), ("output", f"{spec.log_dir}/{spec.stage}_{job_tag(r)}_batch.out")]
    d += list(r.extra)
    return [f"#SBATCH --{k}" if v is True else f"#SBATCH --{k}={shlex.quote(str(v))}" for k, v in d]


def _master_port_line(spec: ScriptSpec) -> str:
    """The job id's port, unless cluster.env names one (exported above): the way out when a site keeps a
    service on the port the formula gives. One from the submitting shell does not count (sbatch copies it)."""
    if any(k == "MASTER_PORT" for k, _ in spec.env):
        return "# MASTER_PORT: cluster.env sets it (exported above)"
    return f"export MASTER_PORT=$(( {spec.master_port_base} + SLURM_JOB_ID % {PORT_SPAN} ))"


def _env_lines(spec: ScriptSpec) -> list[str]:
    lines = [
        "export SUBMITIT_EXECUTOR=slurm",
        "export PYTHONUNBUFFERED=1",
        f"export SLIPWAY_RUN_ID={shlex.quote(spec.run_id)}",
        f"export SLIPWAY_STAGE={spec.stage}",
    ]
    if spec.code_dir:
        lines.append(code_path_line(spec.code_dir))
    for k, v in spec.env:
        # Secrets are forwarded by reference from the submitting environment, never by value.
        lines.append(f'export {k}="${{{k}}}"' if is_secret_name(k) else f"export {k}={shlex.quote(v)}")
    return lines


_LOOP = r"""
# MASTER_ADDR from the first node of the allocation; the port from the job id (same on every node).
export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
{port_line}
restart=${{SLURM_RESTART_COUNT:-0}}
export {alloc_env}="${{SLURM_JOB_START_TIME:-$(date +%s)}}"
state={state}
logs={log_dir}
mkdir -p "$state"
step=""
# USR2 sent to the batch shell only (scancel --signal=USR2 --batch) is forwarded to the step's tasks.
trap '[ -n "$step" ] && kill -USR2 "$step" 2>/dev/null' USR2
attempt=0
while true; do
  export {attempt_env}=$attempt
  srun --unbuffered --kill-on-bad-exit=1 --cpus-per-task={cpus} \
    --output "$logs/{stage}_%j_r${{restart}}_a${{attempt}}_%t.out" \
    --error "$logs/{stage}_%j_r${{restart}}_a${{attempt}}_%t.err" \
{container}    {command} &
  step=$!
  wait "$step"; rc=$?
  while [ "$rc" -gt 128 ] && kill -0 "$step" 2>/dev/null; do wait "$step"; rc=$?; done
  step=""
  echo "slipway: {stage} step attempt $attempt (restart $restart) exited with $rc" >&2
  [ "$rc" -eq 0 ] && exit 0
  # Stopped cleanly after a checkpoint: exit 75, or (when srun killed the slower ranks after the first
  # one exited, turning rc into 143) the marker every stopping rank leaves before exiting.
  if [ "$rc" -eq {requeue} ] || [ -e "$state/{stopped}" ]; then
    # Near the time limit it is a timeout, else a preemption.
    if [ "$SECONDS" -ge {timeout_after_s} ]; then
      n=$(( $(cat "$state/timeouts" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$state/timeouts"
      if [ "$n" -gt {max_timeouts} ]; then
        echo "slipway: timed out $n times (max {max_timeouts})" >&2; exit {requeue}
      fi
    fi
    echo "$(date +%s) requeue restart=$restart attempt=$attempt" >> "$state/{requeues}"
    scontrol requeue "$SLURM_JOB_ID" && sleep 600
    exit {requeue}
  fi
  fatal="$state/{fatal}"
  if [ -e "$fatal" ]; then
    read -r code reason < "$fatal"; echo "slipway: not retrying (a retry would repeat it): $reason" >&2
    exit "$code"
  fi
{exclude}  if [ "$attempt" -ge {max_retries} ]; then exit "$rc"; fi
  attempt=$(( attempt + 1 ))
  echo "$(date +%s) retry attempt=$attempt after rc=$rc" >> "$state/{retries}"
done
"""


# Keeps the nodes the failed attempt named out of the job's next allocation (module doc). Called with the
# named nodes (comma-separated); returns (1) only when it kept them: then the step is retried here.
_EXCLUDE_FN = r"""
slipway_exclude() {{
  local named="$1" excl all usable need helper kept
  excl=$(scontrol show job "$SLURM_JOB_ID" | grep -o 'ExcNodeList=[^ ]*' | cut -d= -f2)
  [ "$excl" = "(null)" ] && excl=""
  all=$( {{ [ -n "$excl" ] && scontrol show hostnames "$excl"; tr , '\n' <<< "$named"; }} \
    | sort -u | paste -sd, -)
  usable=$(sinfo -h -N -p "$SLURM_JOB_PARTITION" -o '%N %t' 2>/dev/null \
    | awk '$2 ~ /^(idle|mix|alloc|comp|plnd)/ && $2 !~ /[*]$/ {{print $1}}' | sort -u \
    | grep -cvxF -f <(tr , '\n' <<< "$all"))
  need=${{SLURM_JOB_NUM_NODES:-1}}
  kept="$(date +%s) kept $named job=$SLURM_JOB_ID restart=$restart attempt=$attempt why="
  if [ "$usable" -lt "$need" ]; then
    kept+="partition $SLURM_JOB_PARTITION would keep $usable usable node(s) for this $need-node job"
  else
    helper=$(sbatch --parsable --job-name="$SLURM_JOB_NAME-exclude" --ntasks=1 --cpus-per-task=1 \
      --time=15 --export=PATH,SLURM_CONF --output="$logs/{stage}_${{SLURM_JOB_ID}}_exclude_%j.out" \
      {helper_flags}--wrap "
        for i in \$(seq 1 300); do
          s=\$(squeue -h -j $SLURM_JOB_ID -o %T); [ -z \"\$s\" ] && exit 0
          case \$s in PENDING|REQUEUE_HOLD) break;; esac; sleep 2
        done
        scontrol update jobid=$SLURM_JOB_ID ExcNodeList=$all; scontrol release $SLURM_JOB_ID")
    if [ -n "$helper" ]; then
      helper=${{helper%%;*}}
      echo "$(date +%s) excluded $named job=$SLURM_JOB_ID restart=$restart attempt=$attempt" \
        "exclude=$all helper=$helper" >> "$state/{exclusions}"
      echo "$(date +%s) requeue restart=$restart attempt=$attempt exclude=$named" >> "$state/{requeues}"
      echo "slipway: excluding node(s) $named from the next allocation: requeued held;" \
        "helper job $helper sets ExcNodeList=$all and releases it" >&2
      scontrol requeuehold "$SLURM_JOB_ID" && sleep 600
      scancel "$helper"
      kept+="scontrol requeuehold was refused (the cluster must allow requeues: JobRequeue)"
    else
      kept+="the helper job that excludes them was refused"
    fi
  fi
  echo "$kept" >> "$state/{exclusions}"
  echo "slipway: node(s) $named named bad, kept: ${{kept#*why=}}; retrying in this allocation" >&2
  return 1
}}"""

_EXCLUDE_CALL = r"""  named=$(cat "$rundir"/{bad_nodes_glob} 2>/dev/null | cut -f1 | sort -u | paste -sd, -)
  if [ -n "$named" ]; then slipway_exclude "$named"; fi
"""

_SHELL_VARS = {"job": "${SLURM_JOB_ID}", "restart": "${restart}", "attempt": "${attempt}"}
# The trainer's marker names (trainer.signals), spelled with the loop's shell variables.
_SHELL_MARKERS = {"stopped": STOPPED_MARKER.format(**_SHELL_VARS),
                  "fatal": FATAL_MARKER.format(**_SHELL_VARS)}


# This attempt's bad-node files (every reporter's), spelled with the loop's shell variables.
_BAD_NODES_GLOB = f"{BAD_NODES_DIR}/" + BAD_NODES_MARKER.format(**_SHELL_VARS, reporter="*")


def _exclude_fn(spec: ScriptSpec) -> str:
    flags = "".join(f"{shlex.quote(f'--{k}={v}')} " for k, v in spec.helper)
    return _EXCLUDE_FN.format(stage=spec.stage, exclusions=EXCLUSIONS, requeues=REQUEUES, helper_flags=flags)


def render_sbatch(spec: ScriptSpec) -> str:
    """The complete sbatch script for one stage."""
    r = spec.resources
    head = [
        "#!/bin/bash",
        f"# Slipway {spec.stage} job of run {spec.run_id} (rendered by orchestrator/render.py)",
    ]
    body = ["", *_env_lines(spec)]
    if spec.setup:
        body += ["", "# setup", *spec.setup]
    flags = ""
    if spec.pyxis is not None:
        body += ["", *pyxis_preamble(spec.pyxis)]
        flags = pyxis_srun_flags(spec.pyxis)
    if r.signal_delay_s is None:
        # CPU stage: one task, no requeue logic, plain srun (exit status is the job's).
        body += [
            "",
            f"srun --unbuffered --kill-on-bad-exit=1 --cpus-per-task={r.cpus_per_task} "
            f"--output {shlex.quote(f'{spec.log_dir}/{spec.stage}_{job_tag(r)}_%t.out')} "
            f"--error {shlex.quote(f'{spec.log_dir}/{spec.stage}_{job_tag(r)}_%t.err')} "
            + (f"{flags} " if flags else "") + spec.command,
        ]
    else:
        timeout_after = max(r.time_limit_min * 60 - r.signal_delay_s - 60, 0)
        if spec.run_dir:
            body += [f"rundir={shlex.quote(spec.run_dir)}", _exclude_fn(spec).strip("\n")]
        body.append(
            _LOOP.format(
                port_line=_master_port_line(spec),
                state=shlex.quote(spec.state_dir),
                log_dir=shlex.quote(spec.log_dir),
                stage=spec.stage,
                cpus=r.cpus_per_task,
                command=spec.command,
                container=f"    {flags} \\\n" if flags else "",
                timeout_after_s=timeout_after,
                max_timeouts=r.max_timeouts,
                max_retries=r.max_retries,
                requeue=EXIT_REQUEUE,
                attempt_env=ATTEMPT_ENV, alloc_env=ALLOC_START_ENV,
                requeues=REQUEUES,
                retries=RETRIES,
                exclude=_EXCLUDE_CALL.format(bad_nodes_glob=_BAD_NODES_GLOB) if spec.run_dir else "",
                **_SHELL_MARKERS,
            ).rstrip("\n")
        )
    return "\n".join(head + sbatch_directives(spec) + body) + "\n"


@dataclass(frozen=True)
class LocalSpec:
    resources: JobResources
    command: str
    folder: str
    stage: str
    env: tuple[tuple[str, str], ...] = field(default_factory=tuple)


def local_parameters(spec: LocalSpec) -> dict[str, object]:
    """submitit LocalExecutor parameters (one node; tasks are processes on this machine)."""
    r = spec.resources
    return {
        "tasks_per_node": r.nodes * r.tasks_per_node,
        "timeout_min": r.time_limit_min,
        "gpus_per_node": r.gpus_per_node,
        "signal_delay_s": r.signal_delay_s or 30,
    }


def render_local(spec: LocalSpec) -> str:
    """A readable record of a local job (the local executor has no script)."""
    params = local_parameters(spec)
    lines = [f"# Slipway {spec.stage} job (submitit LocalExecutor, folder {spec.folder})"]
    lines += [f"# {k}={v}" for k, v in params.items()]
    lines += [f"export {k}={'${' + k + '}' if is_secret_name(k) else shlex.quote(v)}" for k, v in spec.env]
    lines.append(f"{spec.command}  # x{params['tasks_per_node']} processes")
    return "\n".join(lines) + "\n"
