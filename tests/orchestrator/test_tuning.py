"""layout=auto tune=true, the decision (issue 41, items 2 and 3) from the trials' records: measured ones
ranked by tokens/s, failed ones with their reason, the winner and its speed-up over the plan's first
choice, Spearman's rank correlation (checked against scipy), the measurement read from the trainer's own
metrics lines, the stored decision reused; and the Slurm job array the trials run as (its script, and
the queue's answers for an array)."""

from __future__ import annotations

import json
import random

import pytest
import scipy.stats

from orchestrator.base.plan_types import JobResources
from orchestrator.render import ScriptSpec, render_sbatch
from orchestrator.stages import trials, tuning
from orchestrator.stages.trials import FAILED, MEASURED, TrialSpec, begin, measure, write_record
from orchestrator.world.queue import parse_sacct, parse_squeue
from trainer.metrics_file import append_record, metrics_path
from trainer.run_files import RunDir

KEY = "k1"


def _cands(n: int) -> list[dict]:
    return [{"index": i, "name": f"layout{i}", "overrides": {"train": {"micro_batch_size": 2**i}},
             "estimate": {"step_s": 1.0 + i / 10, "tokens_per_s": 100.0 / (1.0 + i / 10),
                          "memory_bytes": 2**20}}
            for i in range(n)]


def _spec(run_dir, index: int, warmup: int = 2, last: int = 6) -> TrialSpec:
    cfg = {"run_dir": str(RunDir(run_dir).trial(index)), "train": {"global_batch_size": 8},
           "model": {"seq_length": 16}}
    return TrialSpec(str(run_dir), index, f"layout{index}", {}, cfg, warmup, last, KEY)


def _measured(run_dir, index: int, tokens_per_s: float, job: str = "9") -> None:
    spec = _spec(run_dir, index)
    begin(spec, job)
    write_record(spec, job, 0, MEASURED, measured={"tokens_per_s": tokens_per_s, "step_s": 128 / tokens_per_s,
                                                   "peak_mem_gb": 1.5, "mfu": 0.4})


def test_the_decision_ranks_the_measured_and_keeps_why_the_others_failed(tmp_path):
    run = str(tmp_path)
    _measured(run, 0, 100.0)
    spec1 = _spec(run, 1)
    begin(spec1, "9")  # out of memory on rank 1; rank 0 then lost its peer (a later, secondary failure)
    write_record(spec1, "9", 1, FAILED, reason="out of memory: CUDA out of memory")
    write_record(spec1, "9", 0, FAILED, reason="RuntimeError: Connection closed by peer")
    _measured(run, 2, 150.0)
    begin(_spec(run, 3), "9")  # no record at all: its watchdog's report says why
    with open(RunDir(RunDir(run).trial(3)).root / "hangs.jsonl", "w") as f:
        f.write(json.dumps({"time": 4e9, "iteration": 2, "idle_s": 5.1, "reporter": 0}) + "\n")
    _measured(run, 4, 999.0, job="8")  # another tuning's job: not this one's
    table = tuning.decide(tuning.Tuning(run, _cands(5), KEY, "9"))
    rows = {r["index"]: r for r in table["rows"]}
    assert [r["index"] for r in table["rows"]] == [2, 0, 1, 3, 4]
    assert rows[1]["status"] == FAILED and rows[1]["reason"] == "out of memory: CUDA out of memory (rank 1)"
    assert rows[3]["status"] == "missing"
    assert rows[3]["reason"].startswith("hang: no training progress for 5.1 s")
    assert rows[4]["status"] == "missing" and rows[4]["reason"].startswith("never started")
    assert table["winner"] == 2 and table["speedup"] == pytest.approx(1.5)
    assert table["spearman"] == pytest.approx(-1.0) and table["spearman_n"] == 2
    text = tuning.format_table(table)
    assert ("layout2 (the plan's #3), 150.0 tokens/s: 1.50× the tokens/s of the plan's first choice "
            "(layout0)") in text
    assert "to pin this layout: layout=manual train.micro_batch_size=4" in text and "40.0%" in text
    assert tuning.apply_winner({"train": {"micro_batch_size": 1, "iters": 9}}, table) == \
        {"train": {"micro_batch_size": 4, "iters": 9}}


def test_the_slurm_array_element_writes_as_its_own_job(tmp_path):
    """On Slurm a trial's records name ``<array id>_<index>``; the decision knows the array id."""
    _measured(str(tmp_path), 1, 50.0, job="41_1")
    table = tuning.decide(tuning.Tuning(str(tmp_path), _cands(2), KEY, "41"), lambda j: "TIMEOUT")
    rows = {r["index"]: r for r in table["rows"]}
    assert rows[1]["status"] == MEASURED and table["winner"] == 1
    assert rows[0]["reason"] == "never started (cancelled, or its job never ran)"
    assert "the plan's first choice (layout0) missing: never started" in tuning.verdict(table)
    begin(_spec(str(tmp_path), 0), "41_0")  # started, then killed without a word: Slurm's state says what
    row = tuning.outcome(str(tmp_path), _cands(1)[0], KEY, "41", lambda j: "TIMEOUT")
    assert "(Slurm: TIMEOUT)" in row["reason"]


def test_the_decision_is_stored_and_reused_until_another_tuning_job(tmp_path):
    run = str(tmp_path)
    _measured(run, 0, 100.0)
    _measured(run, 1, 120.0)
    first = tuning.decided(tuning.Tuning(run, _cands(2), KEY, "9"), rank=0)
    assert first["winner"] == 1
    assert RunDir(run).layout_table_text.read_text().startswith("layout=auto: 2 trial")
    _measured(run, 0, 500.0)  # a record changes; the decision taken stays (a requeue, a relaunch)
    assert tuning.decided(tuning.Tuning(run, _cands(2), KEY, None), rank=0)["decided"] == first["decided"]
    assert tuning.decided(tuning.Tuning(run, _cands(2), KEY, "9"), rank=1)["winner"] == 1
    _measured(run, 0, 300.0, job="10")  # tune=force: job 10 measured again; its trials decide
    again = tuning.decided(tuning.Tuning(run, _cands(2), KEY, "10"), rank=0)
    assert again["winner"] == 0 and again["tune_job"] == "10" and [r["status"] for r in again["rows"]] == [
        MEASURED, "missing"]


def test_no_trial_measured_is_a_permanent_error_with_every_reason(tmp_path):
    run = str(tmp_path)
    spec = _spec(run, 0)
    begin(spec, "9")
    write_record(spec, "9", 0, FAILED, reason="out of memory: x")
    with pytest.raises(tuning.NoLayoutMeasured, match=r"layout0: out of memory: x; layout1: never started"):
        tuning.decided(tuning.Tuning(run, _cands(2), KEY, "9"), rank=0)
    assert "no trial of 2 measured anything" in RunDir(run).layout_table_text.read_text()
    from trainer.signals import permanent_reason

    assert permanent_reason(tuning.NoLayoutMeasured("x"))  # the train job is not retried for it


@pytest.mark.filterwarnings("ignore::scipy.stats.ConstantInputWarning")
def test_spearman_agrees_with_scipy_ties_included():
    rng = random.Random(41)
    for n in (2, 3, 4, 7, 12):
        for _ in range(20):
            x = [rng.randint(0, 4) for _ in range(n)]
            y = [rng.random() for _ in range(n)]
            ours = tuning.spearman(x, y)
            theirs = scipy.stats.spearmanr(x, y).statistic
            if ours is None:  # a constant side: scipy says nan
                assert theirs != theirs
            else:
                assert ours == pytest.approx(theirs, abs=1e-12)
    assert tuning.spearman([1], [2]) is None


def test_the_table_also_ranks_the_estimated_step_times_against_the_measured_ones_ties_kept(tmp_path):
    """Issue 52 item 5: beside the plan's ranking (its tie-breaking included), the estimate itself: equal
    estimates share a rank, as scipy's Spearman gives them; stored in the table and printed with it."""
    run = str(tmp_path)
    cands = _cands(3)
    cands[1]["estimate"]["step_s"] = cands[0]["estimate"]["step_s"]  # 0 and 1 tie: the plan put 0 first
    for index, tokens_per_s in ((0, 100.0), (1, 125.0), (2, 50.0)):
        _measured(run, index, tokens_per_s)
    table = tuning.decide(tuning.Tuning(run, cands, KEY, "9"))
    estimated = [c["estimate"]["step_s"] for c in cands]
    measured = [128 / t for t in (100.0, 125.0, 50.0)]  # _measured's step time
    assert table["spearman_step"] == pytest.approx(scipy.stats.spearmanr(estimated, measured).statistic)
    assert table["spearman"] == pytest.approx(0.5)  # the ranking's 0-before-1 was wrong
    assert table["spearman_step"] == pytest.approx(3**0.5 / 2)  # the estimate called it a tie
    text = tuning.format_table(table)
    assert "plan's ranking vs measured: +0.50 over 3 measured trial(s)" in text
    assert "estimated vs measured step time: +0.87 over 3" in text
    tuning.write_table(run, table)  # stored with the table, as the train job writes it
    assert json.loads(RunDir(run).layout_table.read_text())["spearman_step"] == table["spearman_step"]
    assert "estimated vs measured step time: +0.87" in RunDir(run).layout_table_text.read_text()


def test_the_measurement_is_the_trainers_own_log_lines_after_the_warm_up(tmp_path):
    """Rows written as the trainer writes them (interval_metrics → append_record): the warm-up interval
    and anything after the last measured iteration are left out."""
    from trainer.run.metrics import IntervalStats, StepReport, Throughput, interval_metrics

    spec = _spec(str(tmp_path), 0, warmup=2, last=6)
    spec.run_dir.mkdir(parents=True)
    for it, ms in ((2, 900.0), (4, 100.0), (6, 120.0), (8, 1.0)):
        stats = IntervalStats(loss_sum=2.0, advanced=2, iters=2, elapsed_s=2 * ms / 1e3)
        thr = Throughput(ms, 128 / (ms / 1e3), 1.0, 0.25, 0.5 + it / 100)
        row = interval_metrics(StepReport(it, 7, 0, 1e-3, 8, 1.0), stats, thr)
        append_record(metrics_path(spec.run_dir), {"iteration": it, **row})
    m = measure(spec)
    assert m["intervals"] == 2 and m["step_s"] == pytest.approx(0.11)
    assert m["tokens_per_s"] == pytest.approx(128 / 0.11) and m["peak_mem_gb"] == pytest.approx(0.56)
    assert m["mfu"] == pytest.approx(0.25) and (m["step_min_s"], m["step_max_s"]) == (0.1, 0.12)
    assert trials.failure_reason(__import__("torch").OutOfMemoryError("CUDA out of memory. Tried")) == \
        "out of memory: CUDA out of memory. Tried"


def test_the_trial_array_script_and_the_queue_answers_for_an_array():
    spec = ScriptSpec(JobResources("slipway-x-tune", nodes=2, tasks_per_node=2, array="0-3%2"), "python -m x",
                      "/logs", "tune", "r1", "/state", ("5",), ("6",))
    text = render_sbatch(spec)
    assert "#SBATCH --array=0-3%2" in text and "#SBATCH --dependency=afterok:5,afterany:6" in text
    assert "--output=/logs/tune_%A_%a_batch.out" in text and "--output /logs/tune_%A_%a_%t.out" in text
    sq = parse_squeue("7_1|RUNNING|None\n7_[2-3%2]|PENDING|JobArrayTaskLimit\n8|PENDING|Dependency\n")
    assert sq["7"] == ("RUNNING", "") and sq["7_[2-3%2]"][0] == "PENDING" and sq["8"][0] == "PENDING"
    sa = parse_sacct("10|COMPLETED|0:0|n1||7_0\n11|FAILED|1:0|n1||7_1\n7|COMPLETED|0:0|n1||7_2\n")
    assert sa["7"]["state"] == "FAILED" and sa["7_1"]["state"] == "FAILED"
    assert sa["7_2"]["state"] == "COMPLETED"
    assert parse_sacct("5|COMPLETED|0:0|n1|\n")["5"]["state"] == "COMPLETED"  # a plain job, old format too
