"""Real megatron-core as the oracle of the blend tests: one private install per version under
``.make/mcore/<version>`` (``pip install --no-deps --target``; the wheels need only torch, numpy and
packaging, which the suite has), imported in a subprocess that puts that folder first on ``sys.path``.

The shared, Makefile-wired matrix of versions (issue 27 section 1) is meant to replace ``install``; the
folder convention is the same so the two meet. ``ORACLE`` below runs in the subprocess: megatron-core's own
``BlendedMegatronDatasetBuilder`` builds the blend of the given prefixes and prints, per split, the
(dataset, sample) of every position, each corpus's GPT dataset length, and the tokens of positions.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VERSIONS = ("0.8.0", "0.10.0", "0.13.1", "0.16.1")  # as tests/mcore/versions.py (branch mcore-oracle)


def install(version: str) -> Path:
    """``.make/mcore/<version>``, installed on first use: into ``<version>.tmp``, stamped ``.installed``
    (the mcore-oracle branch's stamp, so either side reuses the other's install), then renamed into place,
    so an interrupted install is redone rather than half-used."""
    target = REPO / ".make" / "mcore" / version
    if (target / ".installed").is_file():
        return target
    tmp = target.with_name(version + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(tmp),
           f"megatron-core=={version}"]
    subprocess.run(cmd, check=True)
    (tmp / ".installed").write_text(" ".join(cmd[5:]) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


ORACLE = r"""
import json, sys, types
import numpy as np
try:
    import pkg_resources  # noqa: F401
except ImportError:  # megatron-core 0.8.0 reads packaging through it; new setuptools no longer ship it
    import packaging.version
    sys.modules["pkg_resources"] = types.SimpleNamespace(packaging=packaging)
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
import megatron.core

class Tok:  # GPTDatasetConfig insists on a tokenizer; sample tokens never consult it
    eod, pad, vocab_size, unique_identifiers = 0, -1, None, {"class": "Tok"}

def blend(a):
    config = GPTDatasetConfig(random_seed=a["seed"], sequence_length=a["seq_length"], blend=(a["prefixes"],
                              a["weights"]), split=a["split"], path_to_cache=None, tokenizer=Tok(),
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    splits = BlendedMegatronDatasetBuilder(GPTDataset, a["sizes"], lambda: True, config).build()
    out = {}
    for i, (name, blend) in enumerate(zip(("train", "valid", "test"), splits)):
        if blend is None or not a["sizes"][i]:
            continue
        di, si = np.asarray(blend.dataset_index), np.asarray(blend.dataset_sample_index)
        tokens = [blend.datasets[int(d)]._query_document_sample_shuffle_indices(int(s))[0].tolist()
                  for d, s in zip(di[:a["read"]], si[:a["read"]])]
        out[name] = {"dataset_index": di.tolist(), "dataset_sample_index": si.tolist(),
                     "lengths": [len(d) for d in blend.datasets], "tokens": tokens}
    return out

out = {"version": megatron.core.__version__, "blends": [blend(a) for a in json.loads(sys.argv[1])]}
print("ORACLE " + json.dumps(out))
"""


def megatron_blends(version: str, cases: list[dict]) -> dict:
    """megatron-core ``version``'s blends (see ``ORACLE``), one per case: ``prefixes``, ``weights``,
    ``sizes`` (train, valid, test samples), ``seq_length``, ``seed``, ``split`` and ``read`` (positions
    whose tokens come back). Returns ``{"version", "blends": [per case {split: ...}]}``."""
    env = {**os.environ, "PYTHONPATH": str(install(version))}  # this version only, not the worktree
    proc = subprocess.run([sys.executable, "-c", ORACLE, json.dumps(cases)], env=env, capture_output=True,
                          text=True, timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("ORACLE ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"megatron-core {version} oracle failed (rc {proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    return json.loads(line[len("ORACLE "):])
