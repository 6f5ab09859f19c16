"""layout=auto tune=true end to end on the local executor (issue 41, item 4): the trials run one after
another on the run's own preprocessed data, two of them made to fail on purpose (the plan's first choice
runs out of memory, another hangs until its watchdog ends it), the table is written (run directory and
W&B offline), training starts with the fastest measured layout — checked in its checkpoint — and a
relaunch reuses the decision unless tune=force. About 85 s on two cores in all (four trials of a 2-rank
tiny GPT, 7 iterations each, then 6 training iterations; then two trials that both fail)."""

from __future__ import annotations

import io
import json

import pytest

from orchestrator.launch.flow import launch
from orchestrator.readback.status import collect, format_rows
from orchestrator.stages.tune import NAME as TUNE
from tests.orchestrator.conftest import compose_cfg
from tests.seam import hook_env
from trainer.checkpoint.protocol import saved_layout
from trainer.run_files import RunDir

pytestmark = pytest.mark.timeout(900)

TINY = [
    "+experiment=codeparrot_smoke", "data.corpus.max_files=12", "data.corpus.max_bytes=200000",
    "tokenizer.vocab_size=300", "data.workers=1", "model.num_layers=4", "model.hidden_size=64",
    "model.num_attention_heads=4", "model.seq_length=64", "model.max_position_embeddings=64",
    "train.global_batch_size=4", "train.eval_iters=1", "train.log_interval=1", "optim.warmup_iters=1",
    "data.split='80,20,0'", "parallel.tp_size=1", "parallel.pp_size=2",  # world 2 (local: tp × pp)
    "train.iters=6", "train.save_interval=6", "train.eval_interval=6", "convert.enabled=false", "eval=none",
    "layout=auto", "tune=true", "autotune.warmup_iters=2", "autotune.iters=4", "autotune.log_interval=2",
    "autotune.micro_batch_sizes=[1,2]", "autotune.recompute=[none,full]", "autotune.hang_timeout_s=5",
]


def _with_hooks(monkeypatch, **hooks: str) -> None:
    for name, value in hook_env(**hooks).items():
        monkeypatch.setenv(name, value)


def test_trials_one_after_another_then_training_with_the_fastest(tmp_path, monkeypatch):
    _with_hooks(monkeypatch, FAIL_TRIAL="0:oom,2:hang")
    done = launch(compose_cfg([*TINY, f"runs_root={tmp_path}", "wait=true"]), out=io.StringIO())
    run = RunDir(done.plan.run_dir)
    assert [r.candidate.name for r in done.plan.proposal.trials(4)] == [
        c["name"] for c in done.plan.stage(TUNE).job.candidates]

    table = json.loads(run.layout_table.read_text())
    rows = {r["index"]: r for r in table["rows"]}
    assert sorted(rows) == [0, 1, 2, 3] and table["trials"] == 4
    assert rows[0]["status"] == "failed" and rows[0]["reason"].startswith("out of memory: CUDA out of memory")
    assert rows[2]["status"] == "failed" and rows[2]["reason"].startswith("hang: no training progress")
    measured = [r for r in table["rows"] if r["status"] == "measured"]
    assert sorted(r["index"] for r in measured) == [1, 3]
    speeds = [r["measured"]["tokens_per_s"] for r in measured]
    assert speeds == sorted(speeds, reverse=True) and table["winner"] == measured[0]["index"]
    assert all(r["measured"]["intervals"] == 2 and r["estimate"]["step_s"] > 0 for r in measured)
    assert table["spearman"] in (-1.0, 1.0) and table["spearman_n"] == 2
    text = run.layout_table_text.read_text()
    first = rows[0]["name"]
    assert f"the plan's first choice ({first}) failed: out of memory" in text and "Spearman" in text

    # One after another: each trial started after the one before it ended.
    started = [json.loads(run.trial_spec(i).read_text())["started"] for i in range(4)]
    ended = [max(json.loads(p.read_text())["time"] for p in run.trial(i).glob("trial_rank*.json"))
             for i in range(4)]
    assert all(started[i + 1] >= ended[i] for i in range(3)), (started, ended)
    assert not any(run.trial(i).joinpath("checkpoints").exists() for i in range(4))  # none kept

    # Training ran at the winner's layout (its checkpoint says so), after saying which and why.
    win = rows[table["winner"]]["overrides"]
    tp, pp, args = saved_layout(str(run.checkpoints), 6)
    assert (tp, pp) == (win["parallel"]["tp_size"], win["parallel"]["pp_size"])
    assert args.micro_batch_size == win["train"]["micro_batch_size"]
    assert args.use_distributed_optimizer == win["optim"]["distributed"]
    states = {r.stage: r for r in collect(str(run.root))}
    assert states[TUNE].state == "COMPLETED" and states["train"].state == "COMPLETED"
    assert f"decision: {rows[table['winner']]['name']}" in format_rows(list(states.values()))

    # W&B (the smoke experiment logs offline): the table as a run of its own, beside the training run.
    (wb,) = run.tune.glob("wandb/offline-run-*/files/media/table/layout/*.table.json")
    logged = json.loads(wb.read_text())
    assert len(logged["data"]) == 4 and "tokens_per_s" in logged["columns"]
    summary = run.summary.read_text()  # what the waiting launch printed at the end
    assert f"layout (auto)    {rows[table['winner']]['name']}" in summary
    assert str(wb.parents[4]) in summary.split("wandb sync")[1]  # its offline run is uploaded too

    # A relaunch reuses the decision (no trials); tune=force measures again.
    again = launch(compose_cfg([*TINY, f"runs_root={tmp_path}", f"run_id={run.root.name}", "train.iters=8",
                                "dry_run=true"]), out=io.StringIO()).text
    assert f"no job: decided already: {rows[table['winner']]['name']}" in again
    forced = launch(compose_cfg([*TINY, f"runs_root={tmp_path}", f"run_id={run.root.name}", "tune=force",
                                 "dry_run=true"]), out=io.StringIO()).text
    assert "decided already" not in forced and "tune=force: the first 4 are measured" in forced


def test_no_trial_measured_stops_training_once_with_every_reason(tmp_path, monkeypatch):
    """Both trials fail: the table says why, training is refused (not retried), nothing was trained."""
    _with_hooks(monkeypatch, FAIL_TRIAL="0:oom,1:oom")
    cfg = compose_cfg([*TINY, f"runs_root={tmp_path}", "wait=true", "autotune.candidates=2"])
    with pytest.raises(RuntimeError, match="did not complete: stage train FAILED"):
        launch(cfg, out=io.StringIO())
    run = RunDir(next((tmp_path / "codeparrot_smoke").iterdir()))
    assert "no trial of 2 measured anything" in run.layout_table_text.read_text()
    states = {r.stage: r for r in collect(str(run.root))}
    assert states[TUNE].state == "COMPLETED" and "none of the 2 trials measured" in states["train"].failure
    assert not list(run.checkpoints.glob("iter_*"))
