"""``python -m orchestrator status RUN_OR_SWEEP_DIR [--plot [PNG]] [--history]`` and ``python -m orchestrator
cancel RUN_OR_SWEEP_DIR``."""

from __future__ import annotations

import argparse
import sys

from trainer.run_files import LOSS_PLOT, RUN_JSON, RunDir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator")
    sub = parser.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("status", help="a table per run and stage (one squeue + one sacct call)")
    st.add_argument("path", help=f"a run directory ({RUN_JSON}) or a sweep directory (sweep.json)")
    st.add_argument(
        "--plot",
        nargs="?",
        const="",
        default=None,
        help=f"also write the loss curves to this PNG (default: PATH/{LOSS_PLOT})",
    )
    st.add_argument(
        "--stale-after",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a rank whose heartbeat is older is stale (default: 5 heartbeat intervals, at least 30 s)",
    )
    st.add_argument("--history", action="store_true",
                    help="also list every launch of the run: when, overrides, job ids, outcome")
    ca = sub.add_parser("cancel", help="cancel every queued or running job of a run or sweep (Slurm, local)")
    ca.add_argument("path", help=f"a run directory ({RUN_JSON}) or a sweep directory (sweep.json)")
    args = parser.parse_args(argv)
    if args.cmd == "cancel":
        return _cancel(args.path)
    from orchestrator.status import collect, format_history, format_rows, launch_notes, plot

    try:
        rows = collect(args.path, args.stale_after)
    except (FileNotFoundError, ValueError) as err:  # not a run, or a damaged sweep.json
        sys.stderr.write(f"{err}\n")
        return 2
    sys.stdout.write("\n".join([format_rows(rows), *launch_notes(args.path)]) + "\n")
    if args.history:
        sys.stdout.write("\nLaunches:\n" + format_history(args.path) + "\n")
    if args.plot is not None:
        out = args.plot or str(RunDir(args.path).loss_plot)
        sys.stdout.write(f"loss curves: {plot(args.path, out)}\n")
    return 0


def _cancel(path: str) -> int:
    from orchestrator.cancel import cancel_run
    from orchestrator.launches import RunRecordError
    from orchestrator.runs import run_dirs_of

    try:
        runs = run_dirs_of(path)
        lines = [f"run {r.name}: {line}" for r in runs for line in cancel_run(str(r))]
    except (FileNotFoundError, ValueError, RunRecordError) as err:
        sys.stderr.write(f"{err}\n")
        return 2
    sys.stdout.write("\n".join(lines or ["nothing to cancel: no job of it is queued or running"]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
