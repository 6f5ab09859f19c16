"""trainer.metrics_file: the one reader of train_metrics.jsonl (replays, torn lines, no torch)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from trainer.metrics_file import (
    TRAIN_LOSS,
    VALID_LOSS,
    last_at_or_before,
    metrics_path,
    read_metrics,
    read_records,
    series,
)
from trainer.run_files import METRICS

ROOT = Path(__file__).resolve().parents[1]


def _write(run: Path, rows: list[dict], tail: str = "") -> None:
    run.mkdir(parents=True, exist_ok=True)
    Path(metrics_path(run)).write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def test_replayed_iteration_keeps_the_last_record_of_its_kind(tmp_path):
    rows = [{"iteration": 10, TRAIN_LOSS: 5.0, "perf/tokens_per_s": 1.0},
            {"iteration": 20, TRAIN_LOSS: 4.0, "perf/tokens_per_s": 2.0},
            {"iteration": 20, VALID_LOSS: 4.2},
            # the run was resumed from iteration 10: 20 is logged again
            {"iteration": 20, TRAIN_LOSS: 3.9, "perf/tokens_per_s": 3.0},
            {"iteration": 20, VALID_LOSS: 4.1},
            {"iteration": 30, TRAIN_LOSS: 3.5}]
    _write(tmp_path, rows)
    train = read_metrics(tmp_path, TRAIN_LOSS)
    assert [(r["iteration"], r.get("perf/tokens_per_s")) for r in train] == [(10, 1.0), (20, 3.0), (30, None)]
    # The eval record of iteration 20 does not displace its train record, nor the other way round.
    assert series(tmp_path, VALID_LOSS) == [(20, 4.1)]
    assert series(tmp_path, TRAIN_LOSS) == [(10, 5.0), (20, 3.9), (30, 3.5)]
    assert last_at_or_before(tmp_path, VALID_LOSS, 25) == {"iteration": 20, VALID_LOSS: 4.1}
    assert last_at_or_before(tmp_path, VALID_LOSS, 19) is None


def test_records_come_in_iteration_order(tmp_path):
    _write(tmp_path, [{"iteration": 30, TRAIN_LOSS: 1.0}, {"iteration": 10, TRAIN_LOSS: 2.0}])
    assert [i for i, _ in series(tmp_path, TRAIN_LOSS)] == [10, 30]


def test_torn_and_foreign_lines_are_skipped(tmp_path):
    rows = [{"iteration": 10, TRAIN_LOSS: 5.0}, {"no": "iteration"}]
    _write(tmp_path, rows, tail='[1, 2]\n"text"\n\n{"iteration": 20, "train/lm_lo')
    with open(metrics_path(tmp_path), "ab") as f:
        f.write(b'\n{"iteration": 15, "x": "\xff"}\n')  # a damaged byte costs nothing else
    assert read_records(tmp_path) == [{"iteration": 10, TRAIN_LOSS: 5.0}, {"iteration": 15, "x": "\ufffd"}]
    assert series(tmp_path, TRAIN_LOSS) == [(10, 5.0)]


def test_missing_file_is_no_records(tmp_path):
    assert read_records(tmp_path / "nowhere") == []
    assert read_metrics(tmp_path, TRAIN_LOSS) == [] and series(tmp_path, VALID_LOSS) == []
    assert last_at_or_before(tmp_path, VALID_LOSS, 100) is None
    (tmp_path / METRICS).mkdir()  # not a file either
    assert read_records(tmp_path) == []


def test_import_loads_no_torch():
    code = "import sys, trainer.metrics_file; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
