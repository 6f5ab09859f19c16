"""A verified model is replaced only by a verified one (trainer/convert/swap.py): the new one is built beside
it in ``<out>.partial`` and renamed in once verified. Killed before verification, killed between the two
renames, out of disk: ``<out>`` stays a verified model that real ``transformers`` loads, and nothing
half-written or unverified loads."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.ci import small_tmpfs
from tests.convert.conftest import make_checkpoint
from tests.seam import hook_env
from tests.waits import NEVER_S
from trainer.convert import swap
from trainer.convert.to_hf import ToHFConfig, VerificationFailed, convert_checkpoint, main
from trainer.convert.verify import VerifyConfig


@pytest.fixture
def two(tmp_path, tokenizer_dir) -> tuple[Path, Path]:
    """Two checkpoints of one shape with different weights: a finished run's, and its relaunch's."""
    return (make_checkpoint(tmp_path / "a", tokenizer_dir, 1, 1, seed=0)[0],
            make_checkpoint(tmp_path / "b", tokenizer_dir, 1, 1, seed=1)[0])


def _wte(folder: Path) -> torch.Tensor:
    """The embedding of the model in ``folder``, loaded as users load it."""
    return AutoModelForCausalLM.from_pretrained(str(folder)).transformer.wte.weight.detach()


def _refused(folder: Path) -> None:
    """transformers will not load ``folder``: it has no config.json (transformers 4.5x raises OSError for an
    empty folder, ValueError "Unrecognized model" beside tokenizer files)."""
    with pytest.raises((OSError, ValueError), match="config.json"):
        AutoModelForCausalLM.from_pretrained(str(folder))


def _killed_at(step: str, ckpt: Path, out: Path) -> None:
    """``python -m trainer.convert.to_hf`` of ``ckpt`` into ``out``, SIGKILLed at ``step`` (tests/seam.py)."""
    env = {**os.environ, **hook_env(CONVERT_FAILPOINT=step)}
    done = subprocess.run([sys.executable, "-m", "trainer.convert.to_hf", "--checkpoint-dir", str(ckpt),
                           "--output-dir", str(out), "--overwrite"], env=env, capture_output=True, text=True,
                          timeout=NEVER_S)
    assert done.returncode == -9, done.stderr[-3000:]


def test_a_conversion_killed_before_verification_leaves_the_verified_model_loadable(tmp_path, two):
    a, b = two
    out = tmp_path / "hf"
    convert_checkpoint(ToHFConfig(a, out))
    old = _wte(out)
    _killed_at("written", b, out)
    torch.testing.assert_close(_wte(out), old, rtol=0, atol=0)  # the verified model, untouched
    partial = swap.partial_dir(out)
    assert (partial / "model.safetensors").is_file() and (partial / swap.UNVERIFIED_CONFIG).is_file()
    assert "did not finish" in (partial / swap.INVALID).read_text()
    _refused(partial)  # written but unverified: not loadable

    result = convert_checkpoint(ToHFConfig(b, out, overwrite=True))  # the relaunch
    assert result.report.passed and not partial.exists() and not swap.previous_dir(out).exists()
    assert not torch.equal(_wte(out), old) and not (out / swap.INVALID).exists()


def test_killed_between_the_renames_a_verified_model_stays_findable_and_the_next_run_puts_it_back(
        tmp_path, two):
    a, b = two
    out = tmp_path / "hf"
    convert_checkpoint(ToHFConfig(a, out))
    old = _wte(out)
    _killed_at("between_renames", b, out)
    partial, previous = swap.partial_dir(out), swap.previous_dir(out)
    assert not out.exists()
    torch.testing.assert_close(_wte(previous), old, rtol=0, atol=0)
    new = _wte(partial)  # verified before the swap began: loadable
    assert not torch.equal(new, old)

    # The next conversion recovers first, even one that then fails its own verification.
    with pytest.raises(VerificationFailed, match="left as it was"):
        convert_checkpoint(ToHFConfig(b, out, overwrite=True, verify=VerifyConfig(tolerance=1e-12)))
    torch.testing.assert_close(_wte(out), new, rtol=0, atol=0)
    assert not previous.exists()
    assert "FAILED" in (partial / swap.INVALID).read_text()
    _refused(partial)


def test_recover_prefers_the_verified_new_model_then_the_previous_one(tmp_path):
    out = tmp_path / "hf"
    partial, previous = swap.partial_dir(out), swap.previous_dir(out)
    for folder, name in ((partial, "new"), (previous, "old")):
        folder.mkdir()
        (folder / swap.CONFIG).write_text(name)
    (partial / swap.INVALID).write_text("verification FAILED")  # not verified: never put in place
    assert "the previous model" in swap.recover(out)
    assert (out / swap.CONFIG).read_text() == "old" and not previous.exists()
    assert swap.recover(out) is None  # nothing left to do


def test_a_full_disk_keeps_the_verified_model_and_says_disk_full(tmp_path, two, capsys):
    a, b = two
    with small_tmpfs(tmp_path / "small", "2m") as mnt:  # one tiny model (~1.2 MB) fits, two do not
        out = mnt / "hf"
        convert_checkpoint(ToHFConfig(a, out))
        old = _wte(out)
        with pytest.raises(OSError, match=r"disk full: converting into .*hf.partial .* is unchanged") as err:
            convert_checkpoint(ToHFConfig(b, out, overwrite=True))
        assert err.value.errno == errno.ENOSPC
        torch.testing.assert_close(_wte(out), old, rtol=0, atol=0)
        assert not swap.partial_dir(out).exists()  # its space given back

        assert main(["--checkpoint-dir", str(b), "--output-dir", str(out), "--overwrite"]) == 2
        said = capsys.readouterr().err
        assert "\nto_hf: error: [Errno 28] disk full: " in said and "Traceback" not in said, said
