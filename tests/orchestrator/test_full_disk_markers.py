"""A stage that fails on a full disk is reported as what it was (a real tmpfs): its ``_FAILED`` marker goes
through the space the stage reserved at its start when nothing else can be written, and ``status`` names
the disk. The convert stage on a full disk keeps the run's verified ``hf/`` (trainer/convert/swap.py)."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from orchestrator.readback import status
from orchestrator.stages.base import NodeStage
from orchestrator.stages.convert import ConvertJob, ConvertStage
from tests.ci import small_tmpfs
from tests.convert.conftest import make_checkpoint
from tests.convert.conftest import tokenizer_dir as tokenizer_dir  # the fixture
from tests.orchestrator.test_status_reasons import _local_job_env
from trainer.convert.run_config import ConvertRunConfig
from trainer.run_files import FAILED, FAILED_RESERVE, RUN_JSON, RunDir

JOB = "2147483646"  # _local_job_env's job id: no such process, so status reads the markers


class FillsTheDisk(NodeStage):
    """Another writer fills the filesystem, then this stage's own write fails (job ``"raise"``), or it
    returns and its _COMPLETE marker cannot be written (job ``"return"``)."""

    def run(self) -> str:
        with open(Path(self.output_dir) / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"x" * 65536)
                    f.flush()
            except OSError as e:
                assert e.errno == errno.ENOSPC
        assert (Path(self.output_dir) / FAILED_RESERVE).is_file()  # taken before the disk filled
        if self.job == "raise":
            raise OSError(errno.ENOSPC, "No space left on device", str(Path(self.output_dir) / "result.bin"))
        return "x" * 10000  # a result too long for the full disk


def _reasons(run_dir: Path, stage: str, state_dir: Path) -> tuple[str, str]:
    """(state, reason) that status gives the stage's local job."""
    entry = {"job_id": JOB, "executor": "local", "state_dir": str(state_dir)}
    (run_dir / RUN_JSON).write_text(json.dumps({"jobs": {stage: [entry]}}))
    row = next(r for r in status.collect(str(run_dir)) if r.stage == stage)
    return row.state, row.failure


@pytest.mark.parametrize("how", ["raise", "return"])
def test_a_stage_whose_disk_filled_up_still_records_why(tmp_path, monkeypatch, how):
    _local_job_env(monkeypatch)
    with small_tmpfs(tmp_path / "small", "1m") as mnt:
        state_dir = mnt / "stages" / "toy"
        with pytest.raises(OSError, match="No space left"):
            FillsTheDisk(how, str(state_dir), [], "k")()
        with pytest.raises(OSError):  # nothing else fits: only the reserved space held the marker
            (state_dir / "probe").write_text("x" * 8192)
        marker = json.loads((state_dir / FAILED).read_text())
        assert marker["job"] == JOB and marker["reason"].startswith("disk full: OSError: [Errno 28]")
        assert not (state_dir / FAILED_RESERVE).exists()
        (tmp_path / "run").mkdir()  # the run's record elsewhere: this disk is full
        assert _reasons(tmp_path / "run", "toy", state_dir) == ("FAILED", marker["reason"])


def test_the_convert_stage_on_a_full_disk_keeps_hf_and_status_says_disk_full(tmp_path, tokenizer_dir,  # noqa: F811
                                                                              monkeypatch):
    _local_job_env(monkeypatch)
    ckpts = [make_checkpoint(tmp_path / name, tokenizer_dir, 1, 1, seed=seed)[0]
             for name, seed in (("a", 0), ("b", 1))]
    with small_tmpfs(tmp_path / "run", "2m") as run_dir:  # one converted tiny model fits, two do not
        run = RunDir(run_dir)
        state_dir = run.stage_state("convert")

        def convert(ckpt: Path) -> None:
            config = ConvertRunConfig(checkpoint_dir=str(ckpt), output_dir=str(run.hf), sample_tokens=4,
                                      vocab_file=str(tokenizer_dir / "vocab.json"),
                                      merge_file=str(tokenizer_dir / "merges.txt"))
            ConvertStage(ConvertJob(str(run_dir), config), str(state_dir), [], "k")()

        convert(ckpts[0])  # the finished run's model
        first = (run.hf / "model.safetensors").read_bytes()
        with pytest.raises(OSError, match="disk full"):
            convert(ckpts[1])  # the relaunch's
        assert (run.hf / "model.safetensors").read_bytes() == first and (run.hf / "config.json").is_file()
        assert not run.hf_partial.exists() and not run.hf_previous.exists()
        state, reason = _reasons(run_dir, "convert", state_dir)
        assert state == "FAILED", state
        assert reason.startswith("OSError: [Errno 28] disk full: converting into "), reason
        assert f"the model in {run.hf} is unchanged" in reason
