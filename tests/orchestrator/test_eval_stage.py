"""The eval stage in the plan (after convert, its own key, eval=none, the experiments' settings), its
problems (consent to execute code, a GPU eval on a CPU cluster, no conversion), its job's resources, and
its results in the summary and in ``status`` (a sweep's best point by pass@1)."""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.planning.plan import PlanInputs, make_plan
from orchestrator.readback.status import collect, format_rows
from orchestrator.readback.summary import write_summary
from orchestrator.stages import get as stage_def
from orchestrator.world.runs import write_json
from tests.orchestrator.conftest import compose_cfg
from trainer.eval.results import results_path
from trainer.run_files import COMPLETE

SMOKE = ["+experiment=codeparrot_smoke"]


def _plan(overrides):
    cfg = compose_cfg(overrides)
    # codeparrot logs to W&B online: a launch needs a key in its environment (checks/secrets.py)
    facts = PlanInputs("r", "/runs/r", environ={"WANDB_API_KEY": "k" * 40})
    return cfg, make_plan(cfg, facts, exists=lambda p: True)


def test_eval_follows_convert_on_the_converted_folder():
    cfg, plan = _plan(SMOKE)
    ev = plan.stage("eval")
    assert [s.name for s in plan.stages][-2:] == ["convert", "eval"] and ev.depends_on == ("convert",)
    assert ev.job.hf_dir == plan.stage("convert").job.config.output_dir == "/runs/r/hf"
    assert ev.job.out_dir == "/runs/r/eval" and ev.job.heldout_prefix.endswith("_content_document")
    assert ev.job.settings.humaneval_problems == 4 and ev.job.settings.n_samples == 2
    assert ev.job.wandb["mode"] == "offline" and ev.job.run_id == "r"
    assert ev.key != plan.stage("convert").key
    assert _plan(SMOKE + ["eval.n_samples=4"])[1].stage("eval").key != ev.key
    assert _plan(SMOKE + ["eval.workers=1"])[1].stage("eval").key == ev.key  # changes no result
    assert _plan(SMOKE + ["optim.lr=1e-4"])[1].stage("eval").key != ev.key  # another model
    assert "eval" not in [s.name for s in _plan(SMOKE + ["eval=none"])[1].stages]
    assert plan.problems == []


def test_codeparrot_runs_the_codex_protocol_on_a_gpu():
    cfg, plan = _plan(["+experiment=codeparrot"])
    s = plan.stage("eval").job.settings
    assert (s.n_samples, s.pass_at_k, s.temperatures, s.top_p) == (200, [1, 10, 100], [0.2, 0.6, 0.8], 0.95)
    assert s.humaneval_problems is None and s.device == "cuda" and plan.problems == []
    res = stage_def("eval").resources(cfg, 8)
    assert res.gpus_per_node == 1 and res.tasks_per_node == 1 and res.time_limit_min == 480
    assert res.partition == cfg.cluster.partition
    cpu = stage_def("eval").resources(compose_cfg(SMOKE), 8)
    assert cpu.gpus_per_node == 0


def test_the_plan_names_the_consent_key_and_the_other_eval_problems():
    _, plan = _plan(SMOKE + ["eval=humaneval", "eval.allow_code_execution=false", "eval.device=cpu"])
    [p] = plan.problems
    assert p.code == "code_execution" and p.key == "eval.allow_code_execution"
    assert "set eval.allow_code_execution=true" in p.fix and "eval=none" in p.fix
    assert _plan(SMOKE + ["eval.allow_code_execution=false", "eval.humaneval_problems=0"])[1].problems == []
    _, plan = _plan(SMOKE + ["eval.device=cuda", "eval.pass_at_k=[1,5]"])
    found = {(p.code, p.key) for p in plan.problems}
    assert found == {("eval_device", "eval.device"), ("eval_k", "eval.pass_at_k")}
    _, plan = _plan(SMOKE + ["convert.enabled=false"])  # nothing to evaluate: no stage, a warning
    assert plan.problems == [] and plan.stages[-1].name == "train"
    assert "convert.enabled=false" in plan.warnings[0]


def _results(pass1: float) -> dict:
    return {"model": "/x/hf", "seconds": 12.0,
            "settings": {"n_samples": 2, "top_p": 0.95},
            "humaneval": {"problems": 4, "pass_at": {"pass@1": pass1, "pass@2": pass1 * 1.5}, "seconds": 9.0,
                          "isolation": "netns+pidns+procfs+nobody",
                          "by_temperature": [{"temperature": 0.2, "pass_at": {"pass@1": pass1}},
                                             {"temperature": 0.8, "pass_at": {"pass@2": pass1 * 1.5}}]},
            "perplexity": {"heldout": {"split": "valid", "tokens": 2048, "loss": 4.0, "perplexity": 54.6}}}


def _run(root: Path, name: str, pass1: float | None) -> Path:
    run = root / name
    (run / "stages" / "eval").mkdir(parents=True)
    write_json(run / "run.json", {"run_id": name, "name": f"{name}:optim.lr={pass1}", "jobs": {
        "eval": [{"job_id": "999999", "executor": "local", "folder": str(run / "jobs" / "eval"),
                  "state_dir": str(run / "stages" / "eval")}]}})
    if pass1 is not None:
        results_path(run).parent.mkdir(parents=True)
        results_path(run).write_text(json.dumps(_results(pass1)))
    return run


def test_status_has_a_pass_at_1_column_and_names_the_best_sweep_point(tmp_path):
    runs = [_run(tmp_path, "p0", 0.125), _run(tmp_path, "p1", 0.25), _run(tmp_path, "p2", None)]
    write_json(tmp_path / "sweep" / "sweep.json", {"sweep_id": "s", "points": [
        {"point": i, "run_dir": str(r)} for i, r in enumerate(runs)]})
    rows = collect(str(tmp_path / "sweep"))
    assert [(r.run, r.stage, r.pass_at_1) for r in rows] == [("p0", "eval", 0.125), ("p1", "eval", 0.25),
                                                             ("p2", "eval", None)]
    text = format_rows(rows)
    head = text.splitlines()[0].split()
    assert "pass@1" in head and "0.2500" in text
    assert "BEST pass@1: 0.2500 run p1 (p1:optim.lr=0.25) of 2 evaluated" in text


def test_summary_reports_pass_at_k_and_perplexity(tmp_path):
    run = _run(tmp_path, "r", 0.25)
    text = write_summary(str(run))
    assert "evaluation       pass@1 0.250 (T=0.2), pass@2 0.375 (T=0.8); 4 problems × 2 samples" in text
    assert "perplexity 54.60 (loss 4.000) on held-out valid split (2,048 tokens)" in text
    assert str(results_path(run)) in text


def test_a_deleted_eval_or_hf_folder_makes_only_its_own_stage_run_again(tmp_path):
    """A relaunch of a finished run does only what is missing (issue 35 item 5): each stage is complete when
    its marker names this plan's key and its outputs exist, so deleting eval/ reruns eval alone, deleting
    hf/ reruns convert (and eval, whose input changed), and another key reruns the stage."""
    run = tmp_path / "r"
    facts = PlanInputs("r", str(run), environ={"WANDB_API_KEY": "k" * 40})
    plan = make_plan(compose_cfg(SMOKE), facts, exists=lambda p: True)
    convert, ev = plan.stage("convert"), plan.stage("eval")
    for stage, files in ((convert, [Path(convert.job.config.output_dir, "config.json")]),
                         (ev, [Path(ev.job.out_dir, "results.json")])):
        for f in files:
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text("{}")
        write_json(Path(stage.state_dir, COMPLETE), {"key": stage.key, "job": "1"})

    def todo() -> list[str]:
        return [s.name for s in (convert, ev) if stage_def(s.name).complete(s) is None]

    assert todo() == []
    (run / "eval" / "results.json").unlink()
    assert todo() == ["eval"]
    Path(ev.job.out_dir, "results.json").write_text("{}")
    write_json(Path(convert.state_dir, COMPLETE), {"key": "another plan's", "job": "1"})
    assert todo() == ["convert"]
    write_json(Path(convert.state_dir, COMPLETE), {"key": convert.key, "job": "1"})
    (run / "hf" / "config.json").unlink()
    assert todo() == ["convert"]
