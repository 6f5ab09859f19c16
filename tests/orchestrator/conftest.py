"""Helpers: compose the shipped Hydra configs the way launch.py does."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from orchestrator.schema import SlipwayConfig, register, to_typed

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "hydra_conf"
register()


def compose_cfg(overrides: list[str]) -> SlipwayConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return to_typed(compose("config", overrides=overrides))


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture
def compose_config():
    return compose_cfg
