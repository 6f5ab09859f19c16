"""Slipway's Hydra sweeper: a multirun (``python launch.py -m ...``) is planned whole before anything is
submitted (orchestrator/launch/sweep.py says how).

Hydra's basic sweeper writes ``multirun.yaml`` into the sweep folder and its basic launcher runs the task
function once per point, each to its end: point 0 was submitted before point 1 was even checked, and a
dry run left an empty sweep folder behind. This sweeper expands the same cartesian product (it is the
basic sweeper's parsing), then runs the task function for every point twice inside
``orchestrator.launch.sweep.collecting``: once to plan, and — only if the verdict allows it — once to submit.
It creates no folder of its own (the task function's calls make only what the points' launches write).

Hydra finds plugins in the ``hydra_plugins`` namespace package (this folder, next to ``launch.py``);
``hydra_conf/config.yaml`` selects it with ``override hydra/sweeper: slipway``.
"""

# No `from __future__ import annotations`: Hydra executes plugin modules outside sys.modules, where a
# dataclass cannot resolve string annotations.
import copy
import sys
from dataclasses import dataclass
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import setup_globals
from omegaconf import OmegaConf, open_dict, read_write


@dataclass
class SlipwaySweeperConf:
    _target_: str = "hydra_plugins.slipway_sweeper.slipway_sweeper.SlipwaySweeper"
    max_batch_size: int | None = None  # unused: every point is planned before any is submitted
    params: dict[str, str] | None = None  # Hydra's hydra.sweeper.params (extra sweep axes), as basic's


ConfigStore.instance().store(group="hydra/sweeper", name="slipway", node=SlipwaySweeperConf,
                             provider="slipway")


class SlipwaySweeper(BasicSweeper):
    """The basic sweeper's points, planned all before any is submitted (module doc)."""

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        super().setup(hydra_context=hydra_context, task_function=task_function, config=config)
        self.task_function = task_function  # called here directly; the basic launcher is not used

    def sweep(self, arguments: list[str]) -> Any:
        from orchestrator.launch import hydra_errors
        from orchestrator.launch import sweep as sweeps

        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        setup_globals()  # Hydra's resolvers (${now:...}), as its launchers register them
        # Resolved once on the sweep's config, whose resolver cache every point's config copies
        # (load_sweep_config): one sweep folder, one timestamp, for all points and both passes.
        str(self.config.hydra.sweep.dir)
        params = self._parse_config()
        params.extend(arguments)
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        batches = self.split_arguments(parser.parse_overrides(params), None)
        points = [list(p) for batch in batches for p in batch]
        with sweeps.collecting() as col:
            self._run_all(points)  # plan every point
            code = col.verdict()
            if code is not None:
                sys.exit(code)  # a dry run, or problems: nothing was written or submitted
            col.phase = sweeps.SUBMIT
            hydra_errors.composed()  # every point composed: nothing of Hydra's switch reaches the jobs
            self._run_all(points)
            col.finish(OmegaConf.to_yaml(self.config))
        return []

    def _run_all(self, points: list[list[str]]) -> None:
        for num, overrides in enumerate(points):
            self._run(num, overrides)

    def _run(self, num: int, overrides: list[str]) -> None:
        """The task function on one point's config, as Hydra's ``run_job`` calls it, minus what run_job
        writes (the job's output folder) and its logging set-up."""
        assert self.hydra_context is not None and self.task_function is not None
        config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(config):
            config.hydra.job.id = num
            config.hydra.job.num = num
        before = HydraConfig.instance().cfg
        HydraConfig.instance().set_config(config)
        try:
            task_cfg = copy.deepcopy(config)
            with read_write(task_cfg), open_dict(task_cfg):
                del task_cfg["hydra"]
            self.task_function(task_cfg)
        finally:
            HydraConfig.instance().cfg = before
