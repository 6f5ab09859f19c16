"""The model checks' shared fixtures: every Slipway run they read, trained once (one spawn per world
size), and per megatron-core version one subprocess that runs all of test_model's, test_llama's and
test_megatron_lm's Megatron jobs (``model_cases``). Session-scoped and parametrised by version, so
pytest runs each version's tests of these modules together and the subprocess once per version."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.mcore import model_cases
from tests.mcore.harness import run_check
from tests.train.harness import spawn, write_dataset


@pytest.fixture(scope="session")
def model_runs(tmp_path_factory) -> dict[str, Path]:
    """name (model_cases.run_configs) -> the iteration folder of that trained Slipway run."""
    root = tmp_path_factory.mktemp("mcore_runs")
    data = write_dataset(str(root / "data"))
    configs = model_cases.run_configs(root, data)
    for world in sorted({w for w, _ in configs.values()}):
        spawn(world, str(root), model_cases.train, *[cfg for w, cfg in configs.values() if w == world])
    return {name: root / name / "checkpoints" / f"iter_{model_cases.ITERS:07d}" for name in configs}


@pytest.fixture(scope="session")
def megatron_models(mcore_version, model_runs, tmp_path_factory):
    """(version, out folder, ids): Megatron's outputs of every model job under that version, in
    ``out/gpt`` and ``out/llama``; ``out/result.json`` is the check's JSON result."""
    version, out = mcore_version, tmp_path_factory.mktemp(f"mcore_models_{mcore_version}")
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    np.save(out / "ids.npy", ids.numpy())
    for family in ("gpt", "llama"):
        (out / family).mkdir()
    jobs = (model_cases.gpt_jobs(version, out / "gpt", out / "ids.npy", model_runs)
            + model_cases.llama_jobs(version, out / "llama", out / "ids.npy", model_runs))
    start = time.monotonic()
    result = run_check(version, "model", jobs=jobs, store=str(out / "store"))
    print(f"TIME {version} megatron {time.monotonic() - start:.1f} s, jobs {result['seconds']}")
    (out / "result.json").write_text(json.dumps(result))
    return version, out, ids


def pytest_collection_modifyitems(config, items):
    """Items of a module with ``ONLY_VERSIONS`` exist only for those megatron-core versions (the others
    lack what the module checks): the rest are deselected, not skipped. Filtering after the
    parametrisation keeps mcore_version's parameters the same in every module, so pytest groups all of a
    version's items around one instance of it (and of megatron_models)."""
    keep, drop = [], []
    for item in items:
        only = getattr(getattr(item, "module", None), "ONLY_VERSIONS", None)
        spec = getattr(item, "callspec", None)
        version = spec.params.get("mcore_version") if spec else None
        (drop if only is not None and version is not None and version not in only else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
