"""``python -m tests.stress [--reps N] [--hogs K] [--out FILE] [NODE ...]`` (``make test-stress``): the
suite's timing-sensitive tests, N times in a row while K processes spin on the CPU, with a table of
failures per test.

These are the tests whose subject is time — a watchdog, a preflight timeout, a signal that must land
mid-run, a sandbox's time limit, a reader waiting for a builder. Each synchronises on its event (see
tests/waits.py); this is the check that none of them still depends on how fast the machine is. A test
that ever fails here is a flake waiting for CI. The Slurm ones run when the devcluster answers
(``eval "$(slurm/devcluster env)"``) and are reported as not run otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TIMING_SENSITIVE = [  # the one list: what each waits for is said in the test itself
    "tests/data/test_preprocess.py::test_interrupted_run_leaves_no_pair",
    "tests/data/test_gpt_dataset.py::test_reader_waits_for_the_builder_then_memory_maps",
    "tests/data/test_gpt_dataset.py::test_rank0_builds_and_other_processes_read_the_same_samples",
    "tests/health/test_watchdog.py",
    "tests/health/test_hang.py",
    "tests/health/test_preflight.py",
    "tests/eval/test_harness.py::test_hostile_completions_are_contained_and_fail",
    "tests/eval/test_harness.py::test_a_forked_daemon_does_not_outlive_its_program",
    "tests/eval/test_harness.py::test_a_socket_to_a_listening_server_is_refused",
    "tests/eval/test_harness.py::test_a_fork_bomb_does_not_starve_the_programs_running_beside_it",
    "tests/train/test_cli.py",
    "tests/train/test_faults.py::test_signals_during_save_do_not_corrupt_it",
    "tests/train/test_kernel_check.py::test_a_clean_check_is_summarised",
    "tests/orchestrator/test_writer_lock.py::test_concurrent_launches_of_one_run_let_exactly_one_through",
    "tests/train/test_wandb_offline.py",  # a bounded probe and a teardown under a cancel
    "tests/health/test_hang_slurm.py",  # slurm
    "tests/health/test_rendezvous.py",  # the preflight's bounded probes of MASTER_ADDR
    "tests/orchestrator/test_multinode.py",  # slurm: the driver cuts a link within the watchdog's limit
]


def _hog() -> None:
    while True:
        pass


def _one_rep(nodes: list[str], rep: int, workdir: Path) -> tuple[Counter, list[str], float]:
    """One pytest run of ``nodes``: outcome per test id, the failures (id: pytest's one-line message, so
    a failure seen once under load can be understood without reproducing it), seconds."""
    xml = workdir / f"rep{rep}.xml"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--junitxml={xml}", *nodes], cwd=REPO, capture_output=True, text=True)
    seconds = time.monotonic() - started
    outcomes: Counter = Counter()
    failed = []
    if not xml.exists():
        return Counter({"<pytest crashed>": 1}), [proc.stdout[-2000:] + proc.stderr[-2000:]], seconds
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        kind, why = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                kind, why = "failed", " ".join((child.get("message") or child.tag).split())[:400]
            elif child.tag == "skipped":
                kind = "skipped"
        outcomes[(name, kind)] += 1
        if kind == "failed":
            failed.append(f"{name}: {why}")
    return outcomes, failed, seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.stress", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--hogs", type=int, default=2, help="processes spinning on the CPU meanwhile")
    ap.add_argument("--streams", type=int, default=1,
                    help="pytest runs at a time (each more load for the others; the reps are shared out)")
    ap.add_argument("--out", help="also write the report here (e.g. bench/results/stress.txt)")
    ap.add_argument("nodes", nargs="*", help="pytest node ids (default: the timing-sensitive list)")
    args = ap.parse_args(argv)
    nodes = args.nodes or TIMING_SENSITIVE
    hogs = [multiprocessing.Process(target=_hog, daemon=True) for _ in range(args.hogs)]
    for h in hogs:
        h.start()
    total: Counter = Counter()
    lines = []
    try:
        with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.streams) as pool:
            reps = {pool.submit(_one_rep, nodes, rep, Path(tmp)): rep for rep in range(1, args.reps + 1)}
            for done in as_completed(reps):
                outcomes, failed, seconds = done.result()
                total.update(outcomes)
                line = "".join([f"rep {reps[done]:2d}/{args.reps}: {seconds:6.1f} s, {len(failed)} failed",
                                *(f"\n    {f}" for f in failed)])
                lines.append(line)
                print(line, flush=True)
    finally:
        for h in hogs:
            h.kill()
    report = _report(args, total, lines)
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")
    return 1 if any(kind == "failed" for _, kind in total) else 0


def _report(args: argparse.Namespace, total: Counter, lines: list[str]) -> str:
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    head = [f"# tests.stress {datetime.datetime.now().isoformat(timespec='seconds')} commit "
            f"{sha.stdout.strip() or 'unknown'}, {os.cpu_count()} cores, {platform.platform()}",
            f"# {args.reps} repetitions, {args.streams} at a time, with {args.hogs} CPU hogs spinning; "
            f"CI={os.environ.get('CI', '')}",
            *lines, "", f"{'test':<100} {'passed':>6} {'failed':>6} {'skipped':>7}"]
    names = sorted({name for name, _ in total})
    rows = [f"{n:<100} {total[(n, 'passed')]:>6} {total[(n, 'failed')]:>6} {total[(n, 'skipped')]:>7}"
            for n in names]
    fails = sum(v for (_, k), v in total.items() if k == "failed")
    return "\n".join([*head, *rows, "", f"{fails} failed in {args.reps} repetitions of {len(names)} tests"])


if __name__ == "__main__":
    sys.exit(main())
