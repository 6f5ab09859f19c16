"""A sweep is all or nothing (orchestrator/launch/sweep.py, hydra_plugins/slipway_sweeper): each point is
planned and checked before any is submitted, one summary lists the points with their overrides, problems and
device-hours, a dry run writes nothing, and each job's name carries its run so ``squeue`` tells the points
apart.

On the devcluster the jobs are held (``--begin`` an hour ahead): they stay PENDING and never run, so the
cases cost only their launches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.launch.flow import EXIT_PROBLEMS
from orchestrator.stages.base import JOB_NAME_MAX, job_name
from tests.orchestrator.conftest import REPO
from tests.orchestrator.devcluster_helpers import TINY_MODEL
from tests.slurm_cli import slurm

SMOKE = ["+experiment=codeparrot_smoke", "data.corpus.max_files=12", "tokenizer.vocab_size=300",
         "logging.wandb.mode=disabled", *TINY_MODEL]
# train.global_batch_size must be a multiple of micro-batch 2 × dp 1: 5 is not, 4 and 8 are.
BAD_MIDDLE = "train.global_batch_size=4,5,8"


def _sweep(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "launch.py"), "-m", *SMOKE, f"runs_root={tmp_path}/runs",
           f"hydra.sweep.dir={tmp_path}/sweep", *args]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=os.environ)


def _points(text: str) -> dict[str, str]:
    """{'point N': its summary block} from the sweep summary."""
    body = text.split("Slipway sweep ", 1)[1]
    blocks, name = {}, None
    for line in body.splitlines()[1:]:
        if line.startswith("  point "):
            name = line.split(":", 1)[0].strip()
            blocks[name] = line
        elif line.startswith("      ") and name:
            blocks[name] += "\n" + line
        else:
            name = None
    return blocks


def test_a_dry_run_of_a_sweep_checks_every_point_and_writes_nothing(tmp_path):
    """One plan in full (the first point's), then a line per point with what differs from it and its
    device-hours, then the summary (issue 52 item 8: three points printed 847 lines)."""
    out = _sweep(tmp_path, BAD_MIDDLE, "dry_run=true")
    assert out.returncode == EXIT_PROBLEMS, out.stderr[-3000:]
    assert out.stdout.count("Slipway plan: experiment") == 1
    assert out.stdout.count("----- train job script") == 1
    assert "sweep_plans=all prints every plan" in out.stdout
    points = _points(out.stdout)
    assert sorted(points) == ["point 0", "point 1", "point 2"], out.stdout[-3000:]
    for name, size in (("point 0", 4), ("point 1", 5), ("point 2", 8)):
        assert f"train.global_batch_size={size}" in points[name] and " device-hours, ETA" in points[name]
    assert "[batch] train.global_batch_size=5" in points["point 1"]
    assert "vs point 0: micro-batches 4 of 2; global batch 8" in points["point 2"], points["point 2"]
    assert "vs point" not in points["point 0"]
    assert "PROBLEMS" not in points["point 0"] and "PROBLEMS" not in points["point 2"]  # the last is checked
    assert "total: " in out.stdout and "dry run: nothing was written or submitted" in out.stdout
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "runs").exists(), list(tmp_path.rglob("*"))
    every = _sweep(tmp_path, BAD_MIDDLE, "dry_run=true", "sweep_plans=all")  # all of it, on request
    assert every.stdout.count("Slipway plan: experiment") == 3, every.stdout[-3000:]
    assert "sweep_plans=all prints" not in every.stdout and len(every.stdout) > 2.5 * len(out.stdout)


def test_job_names_carry_the_run_within_slurms_limit():
    name = job_name("codeparrot", "20261202-161546-a5bef4", "train")
    assert name == "codeparrot-20261202-161546-a5bef4-train"
    long = job_name("x" * 400, "20261202-161546-a5bef4", "preprocess")
    assert len(long.encode()) == JOB_NAME_MAX and long.endswith("-20261202-161546-a5bef4-preprocess")
    wide = job_name("é" * 200, "r1", "train")  # cut on a character boundary, never inside one
    assert len(wide.encode()) <= JOB_NAME_MAX and wide.endswith("-r1-train") and "\ufffd" not in wide
    huge = job_name("exp", "r" * 300, "train")
    assert len(huge.encode()) <= JOB_NAME_MAX and huge.endswith("rrr-train")


def _queued(comment_prefix: str = "slipway:") -> dict[str, tuple[str, str]]:
    """{job id: (name, comment)} of every Slipway job in the queue (by the comment every job carries)."""
    out = {}
    for line in slurm("squeue", "-h", "-o", "%i|%j|%k").splitlines():
        jid, name, comment = line.split("|", 2)
        if comment.startswith(comment_prefix):
            out[jid] = (name, comment)
    return out


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_a_sweep_with_a_bad_point_submits_nothing_and_a_good_one_names_its_jobs(tmp_path):
    held = ["cluster=devcluster", "+cluster.sbatch_extra.begin=now+3600"]
    before = set(_queued())
    refused = _sweep(tmp_path, BAD_MIDDLE, *held)
    assert refused.returncode == EXIT_PROBLEMS, refused.stderr[-3000:]
    assert not set(_queued()) - before, "a point was submitted although point 1 has a problem"
    assert not (tmp_path / "runs").exists() and not (tmp_path / "sweep").exists()
    points = _points(refused.stderr)
    assert "[batch] train.global_batch_size=5" in points["point 1"] and "PROBLEMS" not in points["point 2"]
    assert "nothing was submitted, no point of the sweep" in refused.stderr

    ok = _sweep(tmp_path, "train.global_batch_size=4,8", *held)
    try:
        assert ok.returncode == 0, ok.stderr[-3000:]
        manifest = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
        runs = {p["point"]: Path(p["run_dir"]).name for p in manifest["points"]}
        assert len(runs) == 2 and (tmp_path / "sweep" / "multirun.yaml").is_file()
        mine = {jid: name for jid, (name, _) in _queued().items() if jid not in before}
        for run_id in runs.values():  # every job of a point names its run; the two points' names differ
            names = sorted(n for n in mine.values() if f"-{run_id}-" in n)
            assert f"codeparrot_smoke-{run_id}-train" in names, mine
        trains = [n for n in mine.values() if n.endswith("-train")]
        assert len(trains) == 2 and len(set(trains)) == 2, mine
        shown = _points(ok.stdout)
        assert all(runs[i] in shown[f"point {i}"] and "jobs: " in shown[f"point {i}"] for i in runs), \
            ok.stdout
        status = subprocess.run([sys.executable, "-m", "orchestrator", "status", str(tmp_path / "sweep")],
                                cwd=REPO, capture_output=True, text=True, timeout=120)
        assert status.returncode == 0 and all(r in status.stdout for r in runs.values()), status.stderr
        # What no plan can know: sbatch refuses point 1 (a begin time it cannot parse). The message says
        # which points were submitted, and the manifest lists them.
        half = subprocess.run([sys.executable, str(REPO / "launch.py"), "-m", *SMOKE, "cluster=devcluster",
                               f"runs_root={tmp_path}/runs2", f"hydra.sweep.dir={tmp_path}/sweep2",
                               "+cluster.sbatch_extra.begin=now+3600,not-a-time"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300, env=os.environ)
        assert half.returncode == EXIT_PROBLEMS and "sbatch refused the " in half.stderr, half.stderr
        assert "submitting point 1 failed; points 0 were submitted (their runs are in " in half.stderr
        assert [p["point"] for p in json.loads((tmp_path / "sweep2" / "sweep.json").read_text())["points"]] \
            == [0]
    finally:
        fresh = [j for j in _queued() if j not in before]
        if fresh:
            subprocess.run(["scancel", *fresh], timeout=60, check=False)
