"""The torch_dist common-state reader alone (trainer/checkpoint/dist_read.py read_common, through the
converter's trainer/convert/dist.py read_common and the trainer's saved_layout), without megatron-core:
the megatron-core matrix (tests/mcore) reads what real Megatron writes, this pins each case of the reader.

The fixture is the layout megatron-core 0.19 writes (``dist_checkpointing.save``, core 0.19.2 source):

- no ``common.pt``: the common state dict becomes ``ShardedObject(key="common_state", data=state_dict,
  global_shape=(1,), global_offset=(0,))`` (serialization.py ``save``), whose ``unique_key`` is
  ``common_state/shard_0_1`` (mapping.py);
- a ShardedObject's value is ``torch.save([sh_obj.data ...], BytesIO)`` (strategies/torch.py
  ``_mcore_to_torch_sharded_object``): a pickled one-element list, written as it is by
  ``torch.distributed.checkpoint`` into the ``.distcp`` files beside the tensors (``MCoreSavePlanner``'s
  ``transform_object`` passes the bytes through; torch's default planner would pickle the BytesIO
  object again); ``metadata.json`` names the backend (``save_config``);
- ``load_common_state_dict`` reads ``common.pt`` when there is one (0.7-0.18), else that object.

Megatron-LM's common state holds ``args`` (a Namespace with Megatron's enums and, from core 0.19,
``exit_signal = signal.SIGTERM``), ``iteration`` and ``checkpoint_version``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from tests.convert.test_pickles import _fake_megatron
from trainer.checkpoint import dist_read
from trainer.checkpoint.files import DIST_COMMON, CheckpointError
from trainer.checkpoint.protocol import saved_layout
from trainer.convert.dist import read_common

ITERATION = 7
# ShardedObject("common_state", None, (1,), (0,)).unique_key, spelled as core 0.19 makes it (mapping.py:
# f"{key}/shard_{offset}_{shape}"), not taken from the reader under test.
CORE_019_KEY = "common_state/shard_0_1"


def _pickled(value) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    return buf


class _CoreSavePlanner(DefaultSavePlanner):
    """What megatron-core's MCoreSavePlanner changes that matters here: the bytes go in as they are."""

    def transform_object(self, write_item, object):  # noqa: A002 - torch's parameter name
        return object


def write_core_019(iter_dir: Path, common, key: str = CORE_019_KEY) -> Path:
    """A torch_dist iteration folder as megatron-core 0.19 lays it out (module docstring): one tensor, and
    ``common`` pickled as core 0.19 pickles a ShardedObject's data (``[common]``) under ``key``."""
    state = {"decoder.final_layernorm.weight": torch.arange(4.0)}
    if common is not None:
        state[key] = _pickled(common)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(iter_dir)), planner=_CoreSavePlanner(),
                 no_dist=True)
    (iter_dir / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist",
                                                        "sharded_backend_version": 1}))
    return iter_dir


@pytest.fixture
def args_019(tmp_path, monkeypatch) -> argparse.Namespace:
    """Megatron-LM's args as core 0.19 pickles them: Megatron's ModelType (a fake ``megatron`` package,
    gone again before anything reads) and exit_signal; the parallel sizes saved_layout reads."""
    _fake_megatron(tmp_path / "src")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    from megatron.core.enums import ModelType

    return argparse.Namespace(num_layers=2, tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                              exit_signal=signal.SIGTERM, model_type=ModelType.encoder_or_decoder)


def _forget_megatron(monkeypatch, tmp_path) -> None:
    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path / "src")])


def test_the_common_state_core_019_keeps_in_its_data_files_is_read(tmp_path, monkeypatch, args_019):
    common = {"args": args_019, "iteration": ITERATION, "checkpoint_version": 3.0}
    iter_dir = write_core_019(tmp_path / "iter_0000007", [common])
    _forget_megatron(monkeypatch, tmp_path)
    assert not (iter_dir / DIST_COMMON).exists() and dist_read.has_common(iter_dir)
    got = read_common(iter_dir)
    assert got["iteration"] == ITERATION and got["checkpoint_version"] == 3.0
    args = got["args"]
    assert args.num_layers == 2 and args.exit_signal is signal.SIGTERM
    assert args.model_type.qualname == "megatron.core.enums.ModelType" and args.model_type.value == 1
    assert "megatron" not in sys.modules
    # the trainer's own reader of a saved layout goes the same way
    (tmp_path / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    tp, pp, _ = saved_layout(str(tmp_path), ITERATION)
    assert (tp, pp) == (2, 1)


def test_common_pt_is_read_where_there_is_one(tmp_path):
    """Core 0.7-0.18 (and Slipway's own torch_dist saves) keep it in common.pt, which wins."""
    iter_dir = write_core_019(tmp_path, [{"iteration": 1}])
    torch.save({"iteration": 2}, iter_dir / DIST_COMMON)
    assert read_common(iter_dir)["iteration"] == 2


def test_a_folder_with_no_common_state_is_named(tmp_path):
    iter_dir = write_core_019(tmp_path, None)
    assert not dist_read.has_common(iter_dir)
    with pytest.raises(CheckpointError, match=r"neither common\.pt nor a 'common_state/shard_0_1' object"):
        read_common(iter_dir)


def test_another_objects_key_is_not_the_common_state(tmp_path):
    """A ShardedObject at another offset or shape (an rng_state-like key) is not the common state."""
    iter_dir = write_core_019(tmp_path, [{"iteration": 1}], key="common_state/shard_0_2")
    assert not dist_read.has_common(iter_dir)


def test_a_common_state_that_is_not_a_one_element_list_is_refused(tmp_path):
    iter_dir = write_core_019(tmp_path, {"iteration": 1})  # the dict itself, not [dict]
    with pytest.raises(CheckpointError, match="not a one-element list holding a dict"):
        read_common(iter_dir)


def test_a_common_state_that_would_run_code_is_refused(tmp_path):
    iter_dir = write_core_019(tmp_path, [{"args": argparse.Namespace(x=os.system)}])
    with pytest.raises(CheckpointError, match=r"common_state/shard_0_1.*(posix|os)\.system.*--trust-pickle"):
        read_common(iter_dir)
