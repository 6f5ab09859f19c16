"""The configuration is defined once: the Hydra schema, the launcher's trainer config and the standalone
trainer all use trainer/config's section dataclasses, so no field or default can differ between them."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from orchestrator.base import schema
from orchestrator.planning.plan import PlanInputs, make_plan
from tests.orchestrator.conftest import compose_cfg
from trainer import config as tconfig
from trainer.config_issues import ConfigError

REPO = Path(__file__).resolve().parents[2]
SECTIONS = [f.name for f in dataclasses.fields(tconfig.RunConfig)]


def _defaults(kind: type) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(kind))  # type: ignore[return-value]


def test_hydra_schema_fields_and_defaults_are_the_trainers():
    """Every trainer key, with its default, is in the Hydra schema unchanged (and nothing else is)."""
    hydra = _defaults(schema.SlipwayConfig)
    trainer = _defaults(tconfig.RunConfig)
    for name in SECTIONS:
        assert hydra[name] == trainer[name], name


def test_standalone_trainer_defaults_equal_the_launchers():
    """A section left out of the YAML means the same thing to `launch.py` and to `python -m trainer.run`."""
    bare = tconfig.RunConfig.from_dict({"run_dir": "/r"})
    typed = schema.to_typed(OmegaConf.structured(schema.SlipwayConfig))
    for name in ("model", "parallel", "train", "optim", "tokenizer", "logging"):
        assert getattr(typed, name) == getattr(bare, name), name
    assert dataclasses.replace(typed.checkpoint, dir=None) == dataclasses.replace(bare.checkpoint, dir=None)


@pytest.mark.parametrize("experiment", [[], ["+experiment=codeparrot"]])
def test_the_trainer_receives_the_sections_the_user_composed(experiment):
    cfg = compose_cfg(experiment + ["optim.lr=3e-3", "train.device=cpu", "model.attention_backend=softmax"])
    plan = make_plan(cfg, PlanInputs("r0", "/tmp/never-created/r0"), exists=lambda p: True)
    train = next(s for s in plan.stages if s.name == "train")
    got = tconfig.RunConfig.from_dict(train.job.trainer_config)
    for name in ("model", "parallel", "train", "optim"):
        assert getattr(got, name) == getattr(cfg, name), name
    assert (got.optim.lr, got.train.device, got.model.attention_backend) == (3e-3, "cpu", "softmax")


@pytest.mark.parametrize("experiment", [["+experiment=codeparrot_smoke"], ["model.hidden_size=64"]])
def test_derived_defaults_follow_the_composed_values_not_the_schemas(experiment):
    """ffn_hidden_size defaults to 4·h of *this* config (the schema once baked CodeParrot's 3072 into every
    model that left it out); the stored schema holds no derived value at all."""
    cfg = compose_cfg(experiment)
    assert cfg.model.ffn_hidden_size == 4 * cfg.model.hidden_size != 3072
    stored = OmegaConf.to_container(_stored_schema())
    assert stored["model"]["ffn_hidden_size"] is None and stored["model"]["max_position_embeddings"] is None


def _stored_schema():
    from hydra.core.config_store import ConfigStore

    schema.register()
    return ConfigStore.instance().load("slipway_schema.yaml").node


def test_the_runs_full_config_is_readable_by_the_standalone_trainer():
    """`python -m trainer.run --config <run_dir>/config.yaml` accepts the orchestrator's whole tree."""
    cfg = compose_cfg(["+experiment=codeparrot"])
    got = tconfig.RunConfig.from_dict(dataclasses.asdict(cfg))
    assert got.model == cfg.model and got.train == cfg.train


def test_section_rules_raise_all_at_once_but_defer_under_the_launcher():
    with pytest.raises(ConfigError) as err:
        tconfig.TrainConfig(micro_batch_size=0, precision="fp8")
    assert {i.key for i in err.value.issues} == {"train.micro_batch_size", "train.precision"}
    cfg = compose_cfg(["model.hidden_size=66", "optim.min_lr=1.0", "train.precision=fp8"])
    assert {"hidden_heads", "lr_range", "choice"} <= {p.code for p in cfg.problems()}


def _class_names(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}


def test_no_second_definition_of_a_section():
    """A class named like a trainer section exists only in trainer/config (the copies disagreed once), or
    in the one module a section lives in beside the code that reads it (data.corpus: the corpus builder's,
    so that trainer/data does not import trainer/config back)."""
    names = {cls.__name__ for cls in (tconfig.ModelConfig, tconfig.TrainConfig, tconfig.OptimConfig,
                                      tconfig.DataConfig, tconfig.TokenizerConfig, tconfig.CheckpointConfig,
                                      tconfig.WandbConfig, tconfig.LoggingConfig, tconfig.ParallelConfig,
                                      tconfig.CorpusConfig, tconfig.RunConfig)}
    owners = {*(REPO / "trainer" / "config").glob("*.py"), REPO / "trainer" / "data" / "corpus_config.py"}
    for path in [*REPO.glob("trainer/**/*.py"), *REPO.glob("orchestrator/**/*.py")]:
        if path not in owners:
            assert not names & _class_names(path), path


def test_config_module_imports_no_torch():
    code = ("import sys, trainer.config, orchestrator.base.schema; "
            "assert 'torch' not in sys.modules, 'trainer.config pulled in torch'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
