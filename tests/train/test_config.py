"""RunConfig: sections, validation messages, orchestrator-only keys, YAML round trip."""

import pytest
import yaml

from trainer.config import RunConfig


def test_defaults_and_roundtrip(tmp_path):
    cfg = RunConfig.from_dict({"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                         "seq_length": 32}, "run_dir": str(tmp_path)})
    assert cfg.model.max_position_embeddings == 32
    assert cfg.checkpoint.dir == str(tmp_path / "checkpoints")
    path = tmp_path / "resolved.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    assert RunConfig.from_yaml(str(path)) == cfg


def test_orchestrator_sections_are_ignored():
    cfg = RunConfig.from_dict({"cluster": {"nodes": 2}, "container": {"kind": "none"}, "dry_run": False,
                               "wait": True, "experiment": "x", "train": {"iters": 5},
                               "data": {"paths": "a", "workers": 4, "append_eod": True},
                               "checkpoint": {"load": None}})
    assert cfg.train.iters == 5 and cfg.data.paths == ["a"] and cfg.checkpoint.load == "latest"


@pytest.mark.parametrize("d, words", [
    ({"optim": {"lrr": 1.0}}, ["'lrr'", "did you mean 'lr'"]),
    ({"trian": {}}, ["'trian'", "did you mean 'train'"]),
    ({"model": {"hidden_size": 65, "num_attention_heads": 4}}, ["model.hidden_size", "divisible"]),
    ({"train": {"precision": "fp8"}}, ["train.precision", "fp8", "bf16"]),
    ({"optim": {"lr": 1e-4, "min_lr": 1e-3}}, ["min_lr"]),
    ({"checkpoint": {"load": "best"}}, ["checkpoint.load", "model-only"]),
    ({"logging": {"wandb": {"mode": "on"}}}, ["logging.wandb.mode", "offline"]),
    ({"train": {"micro_batch_size": 0}}, ["train.micro_batch_size", "positive"]),
])
def test_errors_say_what_and_where(d, words):
    with pytest.raises(ValueError) as e:
        RunConfig.from_dict(d)
    for w in words:
        assert w in str(e.value)


def test_trainer_does_not_import_hydra():
    import subprocess
    import sys

    code = ("import sys, trainer.config, trainer.run; "
            "bad = [m for m in ('hydra', 'omegaconf', 'submitit', 'orchestrator') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
