"""The launch flow behind ``launch.py``: facts → plan → (print | refuse | record + submit [+ wait]).

:func:`prepare` (facts, plan, checks, scripts: writes nothing) and :func:`execute` (record, submit, wait)
are the two halves of :func:`launch`; a sweep prepares every point before it executes any
(orchestrator/launch/sweep.py).

Everything it prints or records passes through orchestrator/base/redaction.py's redactor, which knows the
launching environment's secrets and any the config holds (a config that holds one is refused anyway).
``launch.py`` turns the outcome into its exit code: :data:`EXIT_PROBLEMS` when configuration problems
stopped the launch (or a dry run found some), :data:`EXIT_RUN_FAILED` when a waited-for run ended with a
stage that did not complete (:class:`RunFailed`), :data:`EXIT_ERROR` for anything unexpected.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.base import redaction
from orchestrator.base.facts import PlanInputs, SweepInfo
from orchestrator.base.plan_types import Context, Plan, StagePlan
from orchestrator.base.problems import PlanError, arrange
from orchestrator.base.schema import SlipwayConfig
from orchestrator.checks import run_checks
from orchestrator.checks.secrets import known_secrets
from orchestrator.launch.cancel import Stops, cancel_interrupted, ignoring_stops
from orchestrator.launch.submit import (
    After,
    Submitted,
    container_wrapper,
    render_stage,
    stage_folder,
    stage_log_dir,
    submit_plan,
)
from orchestrator.planning.plan import make_plan
from orchestrator.planning.plan_format import format_plan
from orchestrator.readback.follow import LogFollower, failure_tails, log_path
from orchestrator.readback.summary import write_summary
from orchestrator.record import launches
from orchestrator.record.writer_lock import record_writer, single_writer
from orchestrator.stages.train import NAME as TRAIN
from orchestrator.stages.train import run_name
from orchestrator.stages.upstream import NOT_RUN
from orchestrator.world import queue
from orchestrator.world.runs import (
    RUN_JSON,
    add_to_sweep,
    code_version,
    default_run_dir,
    fingerprint,
    git_state,
    hf_vocab_entries,
    mint_run_id,
    read_json,
    tokenizer_dir_fingerprint,
    vocab_entries,
    write_json,
)
from trainer import faults
from trainer.data.hf_tokenizer import HF_TOKENIZER_TYPE
from trainer.log import get_logger
from trainer.run_files import SLURM_LOGS, RunDir

log = get_logger(__name__)

EXIT_ERROR = 1  # an unexpected error (its traceback is printed); Hydra's own errors exit 1 too
EXIT_PROBLEMS = 2  # configuration problems: nothing was submitted (or a dry run found some)
EXIT_RUN_FAILED = 3  # a run launch.py waited for ended with a stage that did not complete


class RunFailed(RuntimeError):
    """A waited-for run ended with a stage that did not complete; the message names the stage, its log and
    the status command."""

    def __init__(self, plan: Plan, failed: list[tuple[str, str, str]]) -> None:
        self.run_dir, self.failed = plan.run_dir, failed  # (stage, state, log) in stage order
        stage, state, path = failed[0]
        later = "".join(f"; {s} {st} (not run: afterok)" for s, st, _ in failed[1:]
                        if not queue.succeeded(st))
        super().__init__(
            f"run {plan.run_id} did not complete: stage {stage} {state}, its log: {path}{later}\n"
            f"  status: python -m orchestrator status {plan.run_dir}"
        )


@dataclass
class LaunchResult:
    plan: Plan
    text: str  # what was printed (redacted)
    submitted: list[Submitted] = field(default_factory=list)


def gather_facts(cfg: SlipwayConfig, sweep: SweepInfo | None = None) -> PlanInputs:
    run_id = cfg.run_id or mint_run_id()
    tok = cfg.tokenizer
    files = [*cfg.data.inputs(), tok.vocab_file or "", tok.merge_file or ""]
    prints = {p: fp for p in files if p and (fp := fingerprint(p))}
    hf = tok.type == HF_TOKENIZER_TYPE
    if hf and (fp := tokenizer_dir_fingerprint(tok.model)):
        prints[tok.model] = fp
    return PlanInputs(
        run_id,
        default_run_dir(cfg, run_id),
        code_version(),
        prints,
        hf_vocab_entries(tok.model) if hf else vocab_entries(tok.vocab_file),
        sweep,
        dict(os.environ),
    )


def scripts_of(cfg: SlipwayConfig, plan: Plan, launch_n: int = 1) -> dict[str, str]:
    """Scripts as launch ``launch_n`` will submit them; upstream job ids are not known yet (<stage>
    placeholders)."""
    def after(s: StagePlan) -> After:
        return After(tuple(f"<{d}>" for d in s.depends_on if d not in s.after_any),
                     tuple(f"<{d}>" for d in s.after_any))

    out = {s.name: render_stage(cfg, plan, s, after(s), launch_n=launch_n) for s in plan.stages}
    wrapper = container_wrapper(cfg, plan)
    if wrapper:
        out["container_exec.sh"] = wrapper
    return out


def _record(cfg: SlipwayConfig, plan: Plan, scripts: dict[str, str], overrides: tuple[str, ...],
            record: launches.LaunchRecord) -> int:
    """Append this launch to the run's history (launches.py) and write its resolved config; its number."""
    from omegaconf import OmegaConf

    run = Path(plan.run_dir)
    RunDir(run).logs.mkdir(parents=True, exist_ok=True)
    resolved = OmegaConf.structured(cfg)
    git = git_state()
    identity = {"run_id": plan.run_id, "experiment": plan.experiment, "name": run_name(cfg, _facts(plan)),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    n = record.begin(identity, {
        "run_dir": plan.run_dir,  # where it ran: a run directory moved since is read where it stands
        "overrides": [redaction.redact(o) for o in overrides],
        "git": {"sha": git["sha"], "dirty": git["dirty"]},
        "config": redaction.REDACTOR.tree(OmegaConf.to_container(resolved)),
        "stages": {s.name: {"key": s.key, "dir": s.state_dir} for s in plan.stages},
        "sweep": dataclasses.asdict(plan.sweep) if plan.sweep else None,
        "scripts": redaction.REDACTOR.tree(scripts),
    })
    path = launches.link_config(plan.run_dir, n)
    path.write_text(redaction.redact(OmegaConf.to_yaml(resolved)))
    if git["diff"]:
        (path.parent / "git.diff").write_text(redaction.redact(git["diff"]))
    wrapper = scripts.get("container_exec.sh")
    if wrapper:
        (run / "container_exec.sh").write_text(redaction.redact(wrapper))
    return n


def _facts(plan: Plan) -> PlanInputs:
    return PlanInputs(plan.run_id, plan.run_dir, sweep=plan.sweep)


def _follow_text(plan: Plan, submitted: list[Submitted]) -> str:
    lines = [f"run dir: {plan.run_dir}"]
    for s in submitted:
        lines.append(f"  {s.stage:<11} {s.action:<18} {s.job_id or ''}")
    lines += [f"follow: python -m orchestrator status {plan.run_dir}",
              f"logs:   python -m orchestrator logs {plan.run_dir} --follow   (any stage, job or attempt: "
              "--help)"]
    if plan.sweep:
        lines.append(f"sweep:  python -m orchestrator status {plan.sweep.sweep_dir} --plot")
    return "\n".join(lines) + "\n"


def wait(plan: Plan, poll_s: float = 5.0, out=sys.stderr, follow: LogFollower | None = None) -> bool:
    """Block until every stage of the run ended; stream state changes and the last loss. True if all ok.

    ``follow``: also stream each local stage's log as it is written (its log lines carry the losses)."""
    from orchestrator.readback.status import collect

    seen: dict[str, str] = {}
    while True:
        if follow is not None:
            follow.poll()
        rows = collect(plan.run_dir)
        for r in rows:
            extra = ""
            if follow is None and r.stage == TRAIN and r.loss:
                extra = f" checkpoint {r.checkpoint_iter}, last loss {r.loss:.4f}"
            if r.failure.startswith(NOT_RUN):  # its one line: the cause is upstream's, shown there
                extra = f" ({r.failure})"
            line = f"{r.state}{f' ({r.reason})' if r.reason else ''}{extra}"
            if seen.get(r.stage) != line:
                seen[r.stage] = line
                out.write(f"[{time.strftime('%H:%M:%S')}] {r.stage} job {r.job_id}: {line}\n")
        if all(queue.ended(r.state) for r in rows):  # a suspended or held job has not ended
            if follow is not None:
                follow.poll()  # the last lines written before the job ended
            return all(queue.succeeded(r.state) for r in rows)
        time.sleep(poll_s)


def _reap(submitted: list[Submitted], timeout_s: float = 30.0) -> None:
    """Collect the ended local job controllers (no zombies; their CPU time counts in this process's)."""
    deadline = time.monotonic() + timeout_s
    for s in submitted:
        while s.job is not None and s.executor == "local" and not s.job.done():
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)


def _stage_log(plan: Plan, stage: str, job_id: str, executor: str) -> str:
    """Where a stage's job logs (task 0's stderr for local jobs; a glob of the rank logs for Slurm)."""
    sp = plan.stage(stage)
    if executor == "local":
        return str(log_path(stage_folder(plan, sp), job_id))
    return os.path.join(stage_log_dir(plan, sp), SLURM_LOGS.format(stage=stage, job=job_id, stream="err"))


def _failed(plan: Plan) -> list[tuple[str, str, str]]:
    """(stage, state, log) from the first stage that did not complete on (later ones are its dependants)."""
    from orchestrator.readback.status import collect

    jobs = launches.current_jobs(read_json(Path(plan.run_dir) / RUN_JSON))
    entries = {s: e[-1] for s, e in jobs.items() if e}
    rows = [(r.stage, r.state, str(entries[r.stage]["job_id"]), entries[r.stage].get("executor", "slurm"))
            for r in collect(plan.run_dir)]
    first = next((i for i, r in enumerate(rows) if not queue.succeeded(r[1])), None)
    if first is None:  # every job completed, yet a stage did not (a marker is missing)
        return [("run", "INCOMPLETE", str(RunDir(plan.run_dir).logs))]
    return [(st, state, _stage_log(plan, st, jid, ex)) for st, state, jid, ex in rows[first:]]


def _wait_local(plan: Plan, submitted: list[Submitted], started: float, out, err) -> None:
    """Follow a blocking run to its end; print the summary, or the failed stages' log tails and raise."""
    local = all(s.executor == "local" for s in submitted)
    follow = LogFollower(plan.run_dir, err) if local else None
    ok = wait(plan, 1.0 if local else 5.0, out=err, follow=follow)
    _reap(submitted)
    write_json(Path(plan.run_dir) / "wait.json", {"ok": ok})
    if not ok:
        failed = _failed(plan)
        streamed = frozenset(follow.offsets) if follow is not None else frozenset()
        err.write(failure_tails(plan.run_dir, [f[0] for f in failed], streamed=streamed))
        raise RunFailed(plan, failed)
    out.write("\n" + write_summary(plan.run_dir, time.monotonic() - started))


def _submit(p: Prepared, overrides: tuple[str, ...]) -> tuple[int, list[Submitted]]:
    """Record the launch and submit its stages under the run's writer lock; (launch number, outcomes)."""
    cfg, plan = p.cfg, p.plan
    with single_writer(plan) as record:  # refuses while a job of this run (or its checkpoint dir) is active
        n = record.next_launch()  # the scripts name it: rendered again only if a launch was recorded since
        scripts = p.scripts if n == p.launch_n else scripts_of(cfg, plan, n)
        _record(cfg, plan, scripts, overrides, record)
        faults.at("launch:recorded")
        submitted = submit_plan(cfg, plan, record)
        train = next((s for s in submitted if s.stage == TRAIN), None)
        record_writer(plan, train.job_id if train else None, cfg.cluster.executor,
                      stage_folder(plan, plan.stage(TRAIN)))
        faults.at("launch:submitted")
        record.set_state(n, launches.SUBMITTED)
    return n, submitted


def _announce(plan: Plan, submitted: list[Submitted], sweep: SweepInfo | None, experiment: str) -> str:
    """Add the point to its sweep's manifest; the text that says where the run is and how to follow it."""
    if sweep:
        add_to_sweep(
            sweep.sweep_dir,
            {
                "point": sweep.point,
                "run_dir": plan.run_dir,
                "overrides": list(sweep.overrides),
                "jobs": {s.stage: s.job_id for s in submitted},
            },
            {"sweep_id": sweep.sweep_id, "experiment": experiment},
        )
    return redaction.redact(_follow_text(plan, submitted))


@dataclass
class Prepared:
    """A planned launch, checked and rendered, not yet recorded or submitted (a sweep plans every point
    before it submits any: orchestrator/launch/sweep.py)."""

    cfg: SlipwayConfig
    plan: Plan
    scripts: dict[str, str]
    sweep: SweepInfo | None = None
    launch_n: int = 1  # the launch the scripts name (the run's next one when prepared)


def prepare(cfg: SlipwayConfig, sweep: SweepInfo | None = None) -> Prepared:
    """Gather the facts, plan, run the launch-time checks and render the job scripts; writes nothing."""
    redaction.REDACTOR.add(redaction.environ_secrets(os.environ) | known_secrets(cfg))
    redaction.install(streams=False)  # the slipway loggers' handlers
    facts = gather_facts(cfg, sweep)
    plan = make_plan(cfg, facts)
    cfg = plan.config or cfg  # layout=auto: the plan's first choice applied (plan.py)
    plan.problems.extend(run_checks(Context(cfg, facts.environ, plan=plan), at="launch"))
    plan.problems[:] = arrange(plan.problems)  # root causes first, over the plan's and the launch's
    try:
        n = launches.LaunchRecord.load(plan.run_dir).next_launch()
    except launches.RunRecordError:
        n = 1  # the run_record check refuses the launch
    return Prepared(cfg, plan, scripts_of(cfg, plan, n), sweep, n)


def launch(cfg: SlipwayConfig, sweep: SweepInfo | None = None, out=sys.stdout,
           overrides: tuple[str, ...] = ()) -> LaunchResult:
    """Plan, then print (dry run), refuse (problems), or record and submit. ``overrides``: the command
    line's, recorded with the launch."""
    started = time.monotonic()
    p = prepare(cfg, sweep)
    out, err = redaction.redacting(out), redaction.redacting(sys.stderr)
    for warning in p.plan.warnings:
        err.write(f"warning: {warning}\n")
    if cfg.dry_run:
        text = redaction.redact(format_plan(p.cfg, p.plan, p.scripts))
        out.write(text)
        return LaunchResult(p.plan, text)
    if p.plan.problems:
        raise PlanError(p.plan.problems)
    return execute(p, out, overrides, started)


def execute(p: Prepared, out=sys.stdout, overrides: tuple[str, ...] = (),
            started: float | None = None) -> LaunchResult:
    """Record and submit a prepared launch free of problems (and wait for it, when it waits)."""
    cfg, plan, sweep = p.cfg, p.plan, p.sweep
    started = time.monotonic() if started is None else started
    out, err = redaction.redacting(out), redaction.redacting(sys.stderr)
    # Default: block for a single local run (its jobs are this machine's processes); never for sweeps,
    # whose points must all be submitted before anything waits.
    do_wait = cfg.wait if cfg.wait is not None else (cfg.cluster.executor == "local" and sweep is None)
    stops, n, submitted = Stops(), None, []
    main = threading.current_thread() is threading.main_thread()  # only it may handle signals
    with stops.installed() if do_wait and main else nullcontext():
        try:
            with stops.deferred() if do_wait and main else nullcontext():
                n, submitted = _submit(p, overrides)
            text = _announce(plan, submitted, sweep, cfg.experiment)
            out.write(text)
            if do_wait:
                _wait_local(plan, submitted, started, out, err)
        except KeyboardInterrupt:
            with ignoring_stops():  # a second Ctrl-C must not leave the cancellation half done
                if n is not None:
                    cancel_interrupted(plan.run_dir, plan.run_id, n, submitted, err)
            raise
    return LaunchResult(plan, text, submitted)
