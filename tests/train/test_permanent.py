"""Which failures a retry would repeat (trainer.signals.permanent_reason): those stop the sbatch loop at
once (the fatal_* marker, exit 78 or 65); the rest (collectives, sick nodes) are retried."""

from __future__ import annotations

import pytest

from trainer.checkpoint.files import CheckpointError, CheckpointSpaceError
from trainer.data.indexed_dataset import IndexedDatasetError
from trainer.signals import permanent_reason


@pytest.mark.parametrize("err", [
    CheckpointSpaceError("not enough space in /c"), CheckpointError("no checkpoint in /c verifies"),
    IndexedDatasetError("bad magic"), FileNotFoundError("/data/x.bin"), ValueError("valid needs 96 samples"),
    KeyError("tokenizer"),
])
def test_failures_that_would_repeat_are_permanent_with_their_reason(err):
    reason = permanent_reason(err)
    assert reason is not None and reason.startswith(type(err).__name__ + ": ")


@pytest.mark.parametrize("err", [
    RuntimeError("[gloo] Connection closed by peer"), OSError(5, "Input/output error"), TimeoutError(),
    MemoryError(),
])
def test_transient_failures_are_retried(err):
    assert permanent_reason(err) is None
