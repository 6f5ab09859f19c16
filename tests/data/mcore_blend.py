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
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VERSIONS = ("0.8.0", "0.10.0", "0.13.1", "0.16.1")


def install(version: str) -> Path:
    """``.make/mcore/<version>``, installed on first use (a stamp file marks a complete install)."""
    target = REPO / ".make" / "mcore" / version
    if not (target / "megatron" / "core" / "datasets").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                        f"megatron-core=={version}"], check=True)
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

a = json.loads(sys.argv[1])
config = GPTDatasetConfig(random_seed=a["seed"], sequence_length=a["seq_length"], blend=(a["prefixes"],
                          a["weights"]), split=a["split"], path_to_cache=None, tokenizer=Tok(),
                          reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
splits = BlendedMegatronDatasetBuilder(GPTDataset, a["sizes"], lambda: True, config).build()
out = {"version": megatron.core.__version__}
for name, blend in zip(("train", "valid", "test"), splits):
    if blend is None or not a["sizes"][("train", "valid", "test").index(name)]:
        continue
    di, si = np.asarray(blend.dataset_index), np.asarray(blend.dataset_sample_index)
    tokens = [blend.datasets[int(d)]._query_document_sample_shuffle_indices(int(s))[0].tolist()
              for d, s in zip(di[:a["read"]], si[:a["read"]])]
    out[name] = {"dataset_index": di.tolist(), "dataset_sample_index": si.tolist(),
                 "lengths": [len(d) for d in blend.datasets], "tokens": tokens}
print("ORACLE " + json.dumps(out))
"""


def megatron_blend(version: str, prefixes: list[str], weights: list[float], sizes: list[int], *,
                   seq_length: int, seed: int, split: str, read: int) -> dict:
    """megatron-core ``version``'s blend of ``prefixes`` (see ``ORACLE``); ``read``: positions whose tokens
    come back."""
    args = {"prefixes": prefixes, "weights": weights, "sizes": sizes, "seq_length": seq_length, "seed": seed,
            "split": split, "read": read}
    env = {**os.environ, "PYTHONPATH": str(install(version))}  # this version only, not the worktree
    proc = subprocess.run([sys.executable, "-c", ORACLE, json.dumps(args)], env=env, capture_output=True,
                          text=True, timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("ORACLE ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"megatron-core {version} oracle failed (rc {proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    return json.loads(line[len("ORACLE "):])
