"""submit_plan against stand-in Slurm commands: each stage's spec is built once, and the script recorded in
the run directory is the one submitit handed sbatch (not a second rendering), identical to the dry run's."""

from __future__ import annotations

import os
from pathlib import Path

from orchestrator.launch.submit import render_stage, stage_folder, submit_plan
from orchestrator.planning.plan import PlanInputs, make_plan
from orchestrator.record.launches import LaunchRecord, launch_dir
from tests.orchestrator.conftest import compose_cfg


def _fake_slurm(bin_dir: Path) -> None:
    """sbatch answers with increasing job ids and keeps a copy of what it got; squeue knows no job."""
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        "#!/bin/sh\nn=$(cat \"$0.count\" 2>/dev/null || echo 500); n=$((n+1)); echo $n > \"$0.count\"\n"
        "for a; do f=$a; done; cp \"$f\" \"$0.got.$n\"\necho \"Submitted batch job $n\"\n")
    (bin_dir / "squeue").write_text("#!/bin/sh\nexit 1\n")
    for f in ("sbatch", "squeue"):
        (bin_dir / f).chmod(0o755)


def test_recorded_script_is_the_submitted_one(tmp_path, monkeypatch):
    _fake_slurm(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    cfg = compose_cfg(["+experiment=codeparrot_smoke", "cluster=devcluster", "container=none",
                       f"runs_root={tmp_path / 'runs'}", f"cache_dir={tmp_path / 'cache'}"])
    facts = PlanInputs("20250101-000000-abcdef", str(tmp_path / "runs" / "r"))
    plan = make_plan(cfg, facts, exists=lambda p: True)
    record = LaunchRecord.load(plan.run_dir)
    n = record.begin({"run_id": plan.run_id}, {})
    submitted = submit_plan(cfg, plan, record)
    assert [s.action for s in submitted] == ["submitted"] * len(plan.stages)
    ids = {s.stage: s.job_id for s in submitted}
    for s in submitted:
        stage = plan.stage(s.stage)
        recorded = (launch_dir(plan.run_dir, n) / "scripts" / f"{s.stage}.sbatch").read_text()
        assert recorded == s.script == (tmp_path / "bin" / f"sbatch.got.{s.job_id}").read_text()
        deps = tuple(ids[d] for d in stage.depends_on)
        dry = render_stage(cfg, plan, stage, deps, launch_n=n)
        assert recorded == dry, f"{s.stage}: dry run and submission differ"
        assert stage_folder(plan, stage) in recorded
