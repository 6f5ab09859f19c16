"""Slipway's entry point: compose the Hydra config, type it, hand it to the orchestrator.

    python launch.py +experiment=codeparrot_smoke                 # the whole pipeline on this machine
    python launch.py +experiment=codeparrot_smoke cluster=devcluster
    python launch.py +experiment=codeparrot dry_run=true          # plan + job scripts, submits nothing
    python launch.py -m +experiment=codeparrot optim.lr=1e-4,3e-4,5e-4   # a sweep; returns at once

Multirun uses Hydra's basic launcher, which calls ``main`` once per point in this process; each call
submits without blocking, and points that need the same preprocessing share one job (content keys).
"""

from __future__ import annotations

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from orchestrator.launcher import launch
from orchestrator.plan import SweepInfo
from orchestrator.schema import register, to_typed
from orchestrator.validate import PlanError

register()


def _sweep_info() -> SweepInfo | None:
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return None
    sweep_dir = os.path.abspath(hc.sweep.dir)
    overrides = tuple(x for x in hc.job.override_dirname.split(",") if x)
    return SweepInfo(os.path.basename(sweep_dir), sweep_dir, int(hc.job.num), overrides)


@hydra.main(config_path="hydra_conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    typed = to_typed(cfg, dict(HydraConfig.get().runtime.choices))
    try:
        result = launch(typed, _sweep_info())
    except PlanError as err:
        sys.stderr.write(f"{err}\n")
        sys.exit(2)
    if typed.dry_run and result.plan.problems:
        sys.exit(2)  # the printed plan lists what would stop a real launch


if __name__ == "__main__":
    main()
