"""``python -m orchestrator`` — what a user reaches for after a launch:

    status RUN_OR_SWEEP_DIR [--plot [PNG]] [--history]   a table per run and stage
    logs RUN [STAGE] [--follow] [--job ID] [--restart R] [--attempt A] [--task T] [--stdout | --batch]
    list [PATH]                                          the runs under runs_root: state, iteration, loss
    cancel RUN_OR_SWEEP_DIR                              every queued or running job of the run(s)

Each finds its runs the same way (runs.run_dirs_of) and asks Slurm once per look (one squeue, one sacct).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.run_files import LOSS_PLOT, RUN_JSON, RunDir


def _runs_root() -> str:
    """The config's default ``runs_root`` (what ``list`` lists without a path)."""
    from orchestrator.base.schema import SlipwayConfig

    return SlipwayConfig.runs_root


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m orchestrator")
    sub = parser.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("status", help="a table per run and stage (one squeue + one sacct call)")
    st.add_argument("path", help=f"a run directory ({RUN_JSON}) or a sweep directory (sweep.json)")
    st.add_argument("--plot", nargs="?", const="", default=None,
                    help=f"also write the loss curves to this PNG (default: PATH/{LOSS_PLOT})")
    st.add_argument("--stale-after", type=float, default=None, metavar="SECONDS",
                    help="a rank whose heartbeat is older is stale (default: 5 heartbeat intervals, "
                         "at least 30 s)")
    st.add_argument("--history", action="store_true",
                    help="also list every launch of the run: when, overrides, job ids, outcome")
    lg = sub.add_parser("logs", help="print or follow a stage's log (any job, restart, attempt, task)")
    lg.add_argument("path", help=f"a run directory ({RUN_JSON})")
    lg.add_argument("stage", nargs="?", default=None,
                    help="default: the first stage that failed, else the first queued or running, else train")
    lg.add_argument("-f", "--follow", action="store_true",
                    help="print as the job writes, through its retries and requeues, until it has ended")
    lg.add_argument("--job", default=None, help="a job id of the stage (any launch; default: the latest)")
    lg.add_argument("--restart", type=int, default=None, help="the requeue (default: the latest)")
    lg.add_argument("--attempt", type=int, default=None,
                    help="the retry in the allocation (default: the latest)")
    lg.add_argument("--task", default=None,
                    help="the rank (default: the rank a failed training job failed with first, else 0)")
    out = lg.add_mutually_exclusive_group()
    out.add_argument("--stdout", action="store_true", help="the task's stdout instead of its stderr")
    out.add_argument("--batch", action="store_true",
                     help="the batch script's own log (retries, requeues, excluded nodes)")
    lg.add_argument("-n", "--lines", type=int, default=None,
                    help="only the last N lines (default: all; with --follow: 10)")
    lg.add_argument("--list", action="store_true", help="list every log file of the stage's jobs instead")
    li = sub.add_parser("list", help="the runs under runs_root: state, iteration, loss (one squeue + sacct)")
    li.add_argument("path", nargs="?", default=_runs_root(),
                    help=f"runs_root (default: {_runs_root()}), an experiment's folder, a sweep or a run")
    ca = sub.add_parser("cancel", help="cancel every queued or running job of a run or sweep (Slurm, local)")
    ca.add_argument("path", help=f"a run directory ({RUN_JSON}) or a sweep directory (sweep.json)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return {"status": _status, "logs": _logs, "list": _list, "cancel": _cancel}[args.cmd](args)
    except KeyboardInterrupt:
        return 130


def _status(args: argparse.Namespace) -> int:
    from orchestrator.readback.status import collect, format_history, format_rows, launch_notes, plot

    try:
        rows = collect(args.path, args.stale_after)
    except (FileNotFoundError, ValueError) as err:  # not a run, or a damaged sweep.json
        sys.stderr.write(f"{err}\n")
        return 2
    from orchestrator.readback.goodput import goodput_notes

    notes = [*launch_notes(args.path, rows), *goodput_notes(args.path)]
    sys.stdout.write("\n".join([format_rows(rows), *notes]) + "\n")
    if args.history:
        sys.stdout.write("\nLaunches:\n" + format_history(args.path) + "\n")
    if args.plot is not None:
        out = args.plot or str(RunDir(args.path).loss_plot)
        sys.stdout.write(f"loss curves: {plot(args.path, out)}\n")
    return 0


def _one_run(path: str) -> Path:
    from orchestrator.world.runs import run_dirs_of

    runs = run_dirs_of(path)
    if len(runs) != 1:
        listed = "\n  ".join(str(r) for r in runs)
        raise ValueError(f"{path} is a sweep of {len(runs)} runs; name one of them:\n  {listed}")
    return runs[0]


def _logs(args: argparse.Namespace) -> int:
    from orchestrator.readback import logs
    from orchestrator.readback.status import collect
    from orchestrator.record.launches import RunRecordError

    try:
        run = _one_run(args.path)
        rows = collect(str(run))
        stage = args.stage or logs.default_stage(rows)
        if args.list:
            sys.stdout.write(logs.listing(run, stage) + "\n")
            return 0
        task = args.task or logs.default_task(rows, stage, args.job)
        sel = logs.Selection(args.job, args.restart, args.attempt, "batch" if args.batch else task,
                             "out" if (args.stdout or args.batch) else "err")
        if args.follow:
            logs.Follower(run, stage, sel, sys.stdout, 10 if args.lines is None else args.lines).run()
            return 0
        entry, files = logs.pick(run, stage, sel)
        if not files:
            raise logs.LogsError(f"no such log of stage {stage}, job {entry['job_id']} (not started yet, or "
                                 f"no such restart/attempt/task); what there is: python -m orchestrator logs "
                                 f"{run} {stage} --list")
        sys.stderr.write(f"──── {stage}: {files[-1].what}: {files[-1].path} ────\n")
        logs.show(files, args.lines, sys.stdout)
    except (FileNotFoundError, ValueError, RunRecordError) as err:  # LogsError is a ValueError
        sys.stderr.write(f"{err}\n")
        return 2
    return 0


def _list(args: argparse.Namespace) -> int:
    from orchestrator.readback.listing import collect_runs, format_runs

    try:
        lines, squeue_error = collect_runs(args.path)
    except (FileNotFoundError, ValueError) as err:
        sys.stderr.write(f"{err}\n")
        return 2
    sys.stdout.write(format_runs(lines, squeue_error))
    return 0


def _cancel(args: argparse.Namespace) -> int:
    from orchestrator.launch.cancel import cancel_run
    from orchestrator.record.launches import RunRecordError
    from orchestrator.world.runs import run_dirs_of

    try:
        runs = run_dirs_of(args.path)
        lines = [f"run {r.name}: {line}" for r in runs for line in cancel_run(str(r))]
    except (FileNotFoundError, ValueError, RunRecordError) as err:
        sys.stderr.write(f"{err}\n")
        return 2
    sys.stdout.write("\n".join(lines or ["nothing to cancel: no job of it is queued or running"]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
