"""``python tests/train/stalled_main.py ITERATION MARKER_DIR --config X.yaml [overrides]``: the trainer's
CLI (``trainer.run.entry.main``, unchanged) with the fault tests' stall at one iteration: after ITERATION the
rank writes ``MARKER_DIR/stalled_<ITERATION>_rank0`` and pauses until a signal arrives. A test that wants
a signal to land mid-run waits for the marker instead of racing a fast run with a sleep."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout, when run as a script

import trainer.run.entry as cli  # noqa: E402
from tests.seam import stall_hook  # noqa: E402


def main(argv: list[str]) -> int:
    iteration, marker_dir, rest = int(argv[0]), argv[1], argv[2:]
    on_step = stall_hook(iteration, marker_dir, rank=0)  # in the main thread, before any signal can come
    run = cli.run
    cli.run = lambda cfg, hooks=None, pstate=None: run(cfg, cli.RunHooks(on_step=on_step), pstate)
    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
