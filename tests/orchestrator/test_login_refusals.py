"""What the login node can know is refused there, dry run included: a model section that differs from the
run's checkpoints (a genuine Megatron-LM checkpoint, compared as the trainer compares), W&B online with no
API key (a netrc written by wandb itself counts as one), and data.paths that the corpus stage would ignore."""

from __future__ import annotations

import io
import shutil

import pytest

from orchestrator.launch.flow import launch
from orchestrator.planning.plan import PlanInputs, make_plan
from tests.convert.conftest import tokenizer_dir as tokenizer_dir  # the fixture
from tests.fixtures import MEGATRON_FIXTURES
from tests.orchestrator.conftest import compose_cfg

FIXTURE = MEGATRON_FIXTURES / "legacy_tp1_pp1"  # 2 layers, hidden 64, 4 heads, ffn 256, pos 64
SMOKE = ["+experiment=codeparrot_smoke", "logging.wandb.mode=disabled"]
SAME_MODEL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
              "model.ffn_hidden_size=256", "model.seq_length=64", "model.max_position_embeddings=64",
              "train.micro_batch_size=2", "train.global_batch_size=4"]


def _dry(tmp_path, *extra: str):
    ckpt = tmp_path / "ckpt"
    if not ckpt.exists():
        shutil.copytree(FIXTURE, ckpt)
    cfg = compose_cfg([*SMOKE, *SAME_MODEL, f"runs_root={tmp_path}/runs", f"cache_dir={tmp_path}/cache",
                       "run_id=r1", f"checkpoint.dir={ckpt}", "dry_run=true", *extra])
    return launch(cfg, out=io.StringIO()).plan, ckpt


def test_a_model_that_differs_from_the_runs_checkpoints_is_refused_in_the_dry_run(tmp_path):
    plan, _ = _dry(tmp_path)
    assert [p for p in plan.problems if p.code == "checkpoint_model"] == []
    plan, ckpt = _dry(tmp_path, "model.hidden_size=128", "model.num_layers=4", "model.ffn_hidden_size=512")
    hits = [p for p in plan.problems if p.code == "checkpoint_model"]
    assert len(hits) == 1, [str(p) for p in plan.problems]
    text = str(hits[0])
    for diff in ("num_layers 2 → 4", "hidden_size 64 → 128", "ffn_hidden_size 256 → 512"):
        assert diff in text, text  # every difference, in one problem
    assert "num_attention_heads" not in text and f"{ckpt}, iteration 7" in text
    assert "another run_id" in text and "checkpoint.load=model-only" in text
    assert "model.num_layers=2 model.hidden_size=64 model.ffn_hidden_size=256" in text
    # the training job, given the same model, refuses the same checkpoint for the same differences
    from trainer.checkpoint.files import CheckpointError
    from trainer.checkpoint.protocol import saved_layout
    from trainer.run.entry import _check_model, gpt_config

    gpt = gpt_config(compose_cfg([*SAME_MODEL, "model.hidden_size=128", "model.num_layers=4",
                                  "model.ffn_hidden_size=512"]).model, 1024)
    with pytest.raises(CheckpointError) as err:
        _check_model(saved_layout(str(ckpt), 7)[2], gpt, str(ckpt), 7)
    assert "{'num_layers': (2, 4), 'hidden_size': (64, 128), 'ffn_hidden_size': (256, 512)}" in str(err.value)


def test_wandb_online_without_a_key_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("NETRC", raising=False)
    cfg = compose_cfg(["+experiment=codeparrot_smoke", "logging.wandb.mode=online"])

    def codes(environ):
        return [p.code for p in make_plan(cfg, PlanInputs("r0", str(tmp_path / "r0"), environ=environ),
                                          exists=lambda p: True).problems]

    assert codes({}) == ["wandb_key"]
    assert codes({"WANDB_API_KEY": "0123456789abcdef" * 2 + "01234567"}) == []
    from wandb.sdk.lib.wbauth.wbnetrc import write_netrc_auth  # `wandb login`'s own netrc writer

    write_netrc_auth(host="https://api.wandb.ai", api_key="f" * 40)
    assert codes({}) == []


@pytest.mark.parametrize("corpus", [True, False])
def test_data_paths_with_the_corpus_stage_are_refused(tmp_path, corpus):
    data = tmp_path / "train.jsonl"
    data.write_text('{"content": "x = 1"}\n')
    extra = [] if corpus else ["data.corpus=null", "tokenizer.vocab_size=300"]
    cfg = compose_cfg([*SMOKE, f"data.paths=[{data}]", *extra])
    problems = make_plan(cfg, PlanInputs("r0", str(tmp_path / "r0")), exists=lambda p: True).problems
    hits = [p for p in problems if p.code == "data_paths_ignored"]
    assert bool(hits) == corpus, [str(p) for p in problems]
    if corpus:
        assert str(data) in str(hits[0]) and "data.corpus=null" in str(hits[0])


def test_an_architecture_change_of_the_same_shape_is_refused_as_the_trainer_refuses_it(tmp_path):
    """RMSNorm instead of LayerNorm has the same parameter shapes: only the architecture comparison the
    trainer makes (config_differences) tells them apart, and the login node makes the same one."""
    plan, ckpt = _dry(tmp_path, "model.normalization=rmsnorm")
    hits = [str(p) for p in plan.problems if p.code == "checkpoint_model"]
    assert len(hits) == 1 and "normalization LayerNorm → RMSNorm" in hits[0], [str(p) for p in plan.problems]
    from trainer.checkpoint.files import CheckpointError
    from trainer.checkpoint.protocol import saved_layout
    from trainer.run.entry import _check_model, gpt_config

    gpt = gpt_config(compose_cfg([*SAME_MODEL, "model.normalization=rmsnorm"]).model, 1024)
    with pytest.raises(CheckpointError, match="'normalization': \\('LayerNorm', 'RMSNorm'\\)"):
        _check_model(saved_layout(str(ckpt), 7)[2], gpt, str(ckpt), 7)


def test_another_tokenizer_than_the_checkpoints_is_refused_before_anything_is_submitted(
        tmp_path, tokenizer_dir):  # noqa: F811 (the fixture)
    """The run's checkpoints record their tokenizer's digest; a relaunch whose vocab/merges differ (replaced
    in place, or tokenizer.* pointed elsewhere) is refused at plan time, as the trainer would refuse it.
    A Megatron-LM checkpoint (no record) is not refused."""
    from orchestrator.base.problems import PlanError
    from tests.convert.conftest import make_checkpoint
    from trainer.data.tokenizer_identity import DIGEST_ARG, identify

    tok = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, tok)
    files = [f"tokenizer.vocab_file={tok / 'vocab.json'}", f"tokenizer.merge_file={tok / 'merges.txt'}"]
    digest = identify({"vocab_file": str(tok / "vocab.json"), "merge_file": str(tok / "merges.txt")}).digest
    ckpt = make_checkpoint(tmp_path, tok, 1, 1, **{DIGEST_ARG: digest})[0]
    over = [*SMOKE, f"runs_root={tmp_path}/runs", f"cache_dir={tmp_path}/cache", "run_id=r1",
            f"checkpoint.dir={ckpt}", "train.iters=1000", *files]

    def hits(*extra: str) -> list[str]:
        plan = launch(compose_cfg([*over, "dry_run=true", *extra]), out=io.StringIO()).plan
        return [str(p) for p in plan.problems if p.code == "checkpoint_tokenizer"]

    assert hits() == []
    merges = (tok / "merges.txt").read_text().splitlines()
    (tok / "merges.txt").write_text("\n".join([merges[0], *merges[2:], merges[1]]) + "\n")  # in place
    found = hits()
    assert len(found) == 1, found
    said = f"the checkpoint {ckpt} iteration 150 was trained with another tokenizer (sha256 {digest[7:19]}…)"
    assert said in found[0] and "resuming would continue training on another vocabulary" in found[0]
    assert f"checkpoint.load=model-only checkpoint.load_dir={ckpt}" in found[0] and "run_id" in found[0]
    with pytest.raises(PlanError, match=r"\[checkpoint_tokenizer\]"):  # the real launch: nothing submitted
        launch(compose_cfg(over), out=io.StringIO())
    assert not (tmp_path / "runs" / "codeparrot_smoke" / "r1" / "run.json").exists()
    assert hits("checkpoint.load=none") == []  # not resuming: nothing to compare
    plan, _ = _dry(tmp_path / "megatron")  # Megatron-LM's checkpoint records none: loaded with a note
    assert [p for p in plan.problems if p.code == "checkpoint_tokenizer"] == []
