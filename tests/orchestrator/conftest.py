"""Helpers: compose the shipped Hydra configs the way launch.py does (the site's hardware applied,
orchestrator/base/site.py; unknown keys refused)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from orchestrator.base.schema import SlipwayConfig, register, to_typed
from orchestrator.base.site import apply_site

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "hydra_conf"
register()


def compose_cfg(overrides: list[str]) -> SlipwayConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
        choices = dict(cfg.hydra.runtime.choices)
        with open_dict(cfg):
            del cfg["hydra"]
        return to_typed(apply_site(cfg, choices, overrides), choices)


def dry_plan(tmp_path: Path, *extra: str):
    """The smoke run's config and plan (run r1 under ``tmp_path``, a dry run unless ``extra`` says not)."""
    from orchestrator.launch.flow import gather_facts
    from orchestrator.planning.plan import make_plan

    cfg = compose_cfg(["+experiment=codeparrot_smoke", f"runs_root={tmp_path}/runs",
                       f"cache_dir={tmp_path}/c", "run_id=r1", "dry_run=true", *extra])
    return cfg, make_plan(cfg, gather_facts(cfg))


def stage_names(*left_out: str) -> list[str]:
    """The registered stages in order (orchestrator/stages: STAGES), but ``left_out``: a smoke run plans
    every stage except ``tune`` (layout=auto tune=true only)."""
    from orchestrator.stages import STAGES

    return [s.name for s in STAGES if s.name not in left_out]


def user_docs() -> str:
    """What users read: README.md and every page of docs/ (the runbook moved there from the README)."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return "\n".join(p.read_text(encoding="utf-8") for p in pages)


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture
def compose_config():
    return compose_cfg
