"""Shared helpers for the training-loop tests: a tiny real dataset, a tiny config, and a gloo launcher.

Distributed tests run real processes (``torch.multiprocessing`` spawn) joined by gloo through a FileStore
(no TCP ports: other test sessions share this machine), with RANK/WORLD_SIZE set as torchrun would.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import numpy as np

VOCAB = 200  # pads to 256 for tp=1 and tp=2 alike


def write_dataset(folder: str, n_docs: int = 300, seed: int = 0) -> str:
    """A real Megatron .bin/.idx of random documents; returns the prefix."""
    from trainer.data.indexed_dataset import IndexedDatasetBuilder

    os.makedirs(folder, exist_ok=True)
    prefix = os.path.join(folder, "tiny_content_document")
    if os.path.exists(prefix + ".idx"):
        return prefix
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for _ in range(n_docs):
        # A noisy fixed successor rule, so a tiny model's loss falls within a few dozen steps.
        doc = [int(rng.integers(0, VOCAB - 1))]
        for _ in range(int(rng.integers(20, 60))):
            nxt = (doc[-1] * 7 + 3) % (VOCAB - 1) if rng.random() < 0.8 else int(rng.integers(0, VOCAB - 1))
            doc.append(nxt)
        builder.add_document(np.array(doc + [VOCAB - 1]))
    builder.finalize(prefix + ".idx")
    return prefix


def tiny_config(run_dir: str, data_prefix: str, **sections) -> dict:
    """A 2-layer GPT with dropout on, deterministic, checkpoints in run_dir; ``sections`` update the dict."""
    d = {
        "run_dir": run_dir,
        "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
                  "vocab_size": VOCAB, "hidden_dropout": 0.1, "attention_dropout": 0.1},
        "data": {"paths": [data_prefix], "split": "90,10,0",
                 "cache_dir": os.path.join(os.path.dirname(data_prefix), "index-cache")},
        "parallel": {"tp_size": 1, "pp_size": 1},
        "optim": {"lr": 1e-2, "min_lr": 1e-3, "warmup_iters": 4, "weight_decay": 0.1},
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "iters": 40, "log_interval": 5,
                  "eval_interval": 20, "eval_iters": 1, "deterministic": True, "device": "cpu"},
        "checkpoint": {"keep": 2},
        "logging": {"wandb": {"mode": "disabled"}},
        "kernels": "auto",
    }
    for section, values in sections.items():
        if isinstance(values, dict) and isinstance(d.get(section), dict):
            d[section] = {**d[section], **values}
        else:
            d[section] = values
    return copy.deepcopy(d)


def _worker(rank: int, world: int, store: str, fn, args) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def spawn(world: int, store_dir: str, fn, *args) -> None:
    """Run ``fn(rank, *args)`` on ``world`` fresh gloo processes (fn must be importable)."""
    import multiprocessing

    import torch.multiprocessing as mp

    # A fork server that has imported torch and the trainer once: each launch then costs a fork, not
    # an interpreter start and a torch import per rank (seconds each on this shared machine).
    multiprocessing.set_forkserver_preload(["torch", "torch._dynamo", "trainer.run", "tests.train.harness"])
    store = os.path.join(store_dir, f"store-{os.getpid()}-{len(os.listdir(store_dir))}")
    mp.start_processes(_worker, args=(world, store, fn, args), nprocs=world, start_method="forkserver")


def save_json(path: str, value) -> None:
    with open(path, "w") as f:
        json.dump(value, f)


def load_json(path: str):
    with open(path) as f:
        return json.load(f)


def run_cfg(d: dict, hooks=None):
    from trainer.config import RunConfig
    from trainer.run import run

    return run(RunConfig.from_dict(d), hooks)


def python() -> str:
    return sys.executable
