"""Checkpoints both ways between Slipway and megatron-core's GPTModel, version by version.

In: Megatron-core's GPTModel (local layer spec, gloo, CPU) built from the args of a checkpoint Slipway's
trainer wrote with checkpoint.format=mcore, each tp rank loading its shard with
``load_state_dict(strict=True)`` as Megatron-LM's ``load_checkpoint`` does, gives Slipway's logits
(tp 1 and tp 2; the runs train 2 steps so biases and norms are off their init). And Megatron-core's
``dist_checkpointing.load`` of a checkpoint Slipway wrote with checkpoint.format=torch_dist at tp 1 or 2
into GPTModel's ``sharded_state_dict()`` at tp 1 or 2 gives the same logits.

Out: a GPTModel's own weights at tp 2, saved the way Megatron-LM saves ``--ckpt-format torch_dist``
(``sharded_state_dict`` + ``dist_checkpointing.save``; 0.8.0: ``--ckpt-format torch``, see
versions.EXPORT_FORMAT), with the args Megatron-LM writes: a genuine
core_v0.8.0 fixture's, and ``add_qkv_bias=True`` from 0.10 on, which validate_args sets whenever
``add_bias_linear`` is), converts with ``python -m trainer.convert.to_hf`` and the HF model gives
Megatron's logits, and starts a Slipway run (checkpoint.load=model-only at tp 1) whose checkpoint
still does.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.mcore.model_cases import DIST_LAYOUTS, FIXTURES, ITERS, LOW_REL, train
from tests.mcore.versions import COMMON_NEEDS_NAMESPACE
from tests.train.harness import spawn, tiny_config, write_dataset
from trainer.convert.reference import SlipwayGPTSource
from trainer.convert.shards import load_merged
from trainer.convert.spec import spec_from_checkpoint


@pytest.fixture
def runs(model_runs) -> dict:
    """tp -> the iteration folder of the trained tp-way GPT-2 run written in Megatron-core names (torch
    format); "dist{tp}" -> the same run written with checkpoint.format=torch_dist (same weights)."""
    return {1: model_runs["mcore1"], 2: model_runs["mcore2"], "dist1": model_runs["dist1"],
            "dist2": model_runs["dist2"]}


@pytest.fixture
def megatron(megatron_models):
    """(version, Megatron's GPT outputs, ids): conftest's subprocess per version (model_cases.gpt_jobs)."""
    version, out, ids = megatron_models
    return version, out / "gpt", ids


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_gpt_model_reproduces_slipways_logits(runs, megatron, tp):
    version, out, ids = megatron
    merged = load_merged(runs[tp], ITERS)
    spec = spec_from_checkpoint(merged.args, merged.state, merged.checkpoint_version, None)
    source = SlipwayGPTSource(merged.state, spec)
    ours = torch.stack([source.logits(row) for row in ids])
    theirs = torch.from_numpy(np.load(out / f"in_tp{tp}.npy"))
    assert theirs.shape == (2, 16, 256) and ours.shape == (2, 16, spec.vocab_size)
    diff = (theirs[..., :spec.vocab_size] - ours).abs().max().item()
    print(f"MATRIX {version} in tp{tp} {diff:.2e}")
    assert diff <= 1e-5, f"megatron-core {version} tp {tp}: max |logit diff| {diff:.3g}"


def test_slipways_torch_dist_checkpoint_holds_the_runs_weights(runs):
    """The expected side of the next test: the torch_dist runs trained exactly as the torch-format ones
    (Slipway's reader of torch_dist, trainer.convert.dist, gives the very same tensors)."""
    for tp in (1, 2):
        torch_format, dist = load_merged(runs[tp], ITERS).state, load_merged(runs[f"dist{tp}"], ITERS).state
        assert torch_format.keys() == dist.keys()
        assert all(torch.equal(torch_format[k], dist[k]) for k in dist), f"tp {tp}"


@pytest.mark.parametrize("saved_tp,megatron_tp", DIST_LAYOUTS)
def test_megatron_loads_slipways_torch_dist_checkpoint(runs, megatron, saved_tp, megatron_tp):
    """checkpoint.format=torch_dist: megatron-core's dist_checkpointing.load fills GPTModel's
    sharded_state_dict() at tp 2 from a checkpoint Slipway wrote at tp 1 and the other way round, and
    computes the logits of Slipway's weights (read from the torch-format twin run: no torch_dist code)."""
    version, out, ids = megatron
    merged = load_merged(runs[saved_tp], ITERS)
    spec = spec_from_checkpoint(merged.args, merged.state, merged.checkpoint_version, None)
    ours = torch.stack([SlipwayGPTSource(merged.state, spec).logits(row) for row in ids])
    theirs = torch.from_numpy(np.load(out / f"dist_s{saved_tp}_m{megatron_tp}.npy"))
    diff = (theirs[..., :spec.vocab_size] - ours).abs().max().item()
    print(f"MATRIX {version} torch_dist saved-tp{saved_tp} megatron-tp{megatron_tp} {diff:.2e}")
    assert diff <= 1e-5, f"megatron-core {version}: max |logit diff| {diff:.3g}"


def test_which_megatron_versions_need_namespace_allowed_to_read_common_pt(megatron):
    """The one thing the torch_dist check does beyond Megatron's own calls (checks._load_dist), shown
    per version: without it 0.8/0.10 refuse common.pt on this torch, for an upstream reason
    (versions.COMMON_NEEDS_NAMESPACE); 0.13/0.16 read it as they come."""
    version, out, _ = megatron
    as_is = json.loads((out.parent / "result.json").read_text())["common_as_is"]
    if version in COMMON_NEEDS_NAMESPACE:
        assert as_is.startswith("UnpicklingError: Weights only load failed"), as_is
    else:
        assert as_is == "ok", as_is


def test_megatron_gpt_model_weights_convert_with_to_hf(tmp_path, megatron):
    from transformers import GPT2LMHeadModel

    from trainer.convert.to_hf import main

    version, out, ids = megatron
    assert main(["--checkpoint-dir", str(out / "export"), "--output-dir", str(tmp_path / "hf")]) == 0
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        ours = hf(ids).logits
    theirs = torch.from_numpy(np.load(out / "export.npy"))
    diff = (theirs[..., :ours.shape[-1]] - ours).abs().max().item()
    print(f"MATRIX {version} out {diff:.2e}")
    assert diff <= 1e-5, f"megatron-core {version}: HF logits differ from GPTModel's by {diff:.3g}"


def test_megatron_gpt_model_weights_start_a_slipway_run(tmp_path, megatron):
    """checkpoint.load=model-only from the GPTModel's save at tp 1 (it was saved at tp 2); the one step
    has learning rate 0 (warm-up), so the run's checkpoint still computes Megatron's logits."""
    from transformers import GPT2LMHeadModel

    from trainer.convert.to_hf import main

    version, out, ids = megatron
    tok = FIXTURES / "tokenizer"
    cfg = tiny_config(str(tmp_path / "run"), write_dataset(str(tmp_path / "data")),
                      model={"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
                             "max_position_embeddings": 64, "vocab_size": 1024, "hidden_dropout": 0.0,
                             "attention_dropout": 0.0},
                      optim={"warmup_iters": 4},
                      train={"micro_batch_size": 1, "global_batch_size": 1, "iters": 1,
                             "eval_interval": None},
                      tokenizer={"vocab_file": str(tok / "vocab.json"),
                                 "merge_file": str(tok / "merges.txt")},
                      checkpoint={"load": "model-only", "load_dir": str(out / "export")})
    spawn(1, str(tmp_path), train, cfg)
    assert main(["--checkpoint-dir", str(tmp_path / "run" / "checkpoints"), "--output-dir",
                 str(tmp_path / "hf")]) == 0
    with torch.no_grad():
        ours = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()(ids).logits
    theirs = torch.from_numpy(np.load(out / "export.npy"))
    diff = (theirs[..., :ours.shape[-1]] - ours).abs().max().item()
    print(f"MATRIX {version} run-start {diff:.2e}")
    assert diff <= 1e-5, f"megatron-core {version}: the run's weights give logits {diff:.3g} away"


def _slipway(iter_dir, ids) -> torch.Tensor:
    merged = load_merged(iter_dir, ITERS)
    spec = spec_from_checkpoint(merged.args, merged.state, merged.checkpoint_version, None)
    return torch.stack([SlipwayGPTSource(merged.state, spec).logits(row) for row in ids])


def _diff(theirs: torch.Tensor, ours: torch.Tensor) -> float:
    return (theirs[..., :ours.shape[-1]] - ours).abs().max().item()


def test_megatron_loads_slipways_fp16_checkpoint(model_runs, megatron):
    """train.precision=fp16 with the distributed optimizer keeps fp16 weights, as --fp16 saves them: the
    GPTModel Megatron-LM's --fp16 builds loads them; its fp32 twin (same weights upcast) gives Slipway's
    logits exactly, its fp16 forward within the 16-bit bound (model_cases.LOW_REL)."""
    version, out, ids = megatron
    shard = torch.load(model_runs["gpt_fp16"] / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert {t.dtype for t in shard["model"].values() if torch.is_tensor(t)} == {torch.float16}
    ours = _slipway(model_runs["gpt_fp16"], ids)  # fp32 arithmetic on the fp16 weights
    exact = _diff(torch.from_numpy(np.load(out / "in_fp16_fp32.npy")), ours)
    fp16 = _diff(torch.from_numpy(np.load(out / "in_fp16.npy")), ours)
    print(f"MATRIX {version} fp16 in tp2 weights {exact:.2e} fp16-forward {fp16:.2e} "
          f"(max |logit| {ours.abs().max().item():.2f})")
    assert exact <= 1e-5, f"megatron-core {version}: the loaded fp16 weights give logits {exact:.3g} away"
    bound = LOW_REL["fp16"] * ours.abs().max().item()
    assert fp16 <= bound, f"megatron-core {version}: its fp16 forward is {fp16:.3g} from fp32"


def test_megatron_fp16_weights_convert_with_to_hf(tmp_path, megatron):
    """A --fp16 GPTModel's weights (Float16Module: every parameter fp16) convert to an fp16 GPT-2; in fp32
    arithmetic it gives the fp32 twin's logits exactly, in fp16 the GPTModel's within the bound."""
    from transformers import GPT2LMHeadModel

    from trainer.convert.to_hf import main

    version, out, ids = megatron
    assert main(["--checkpoint-dir", str(out / "export_fp16"), "--output-dir", str(tmp_path / "hf")]) == 0
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf", torch_dtype=torch.float16).eval()
    assert hf.lm_head.weight.dtype == torch.float16
    with torch.no_grad():
        ours_fp16 = hf(ids).logits.float()
        ours_fp32 = hf.float()(ids).logits
    theirs_fp32 = torch.from_numpy(np.load(out / "export_fp16_fp32.npy"))
    theirs_fp16 = torch.from_numpy(np.load(out / "export_fp16.npy"))
    exact, fp16 = _diff(theirs_fp32, ours_fp32), _diff(theirs_fp16, ours_fp16)
    own = _diff(theirs_fp16, theirs_fp32[..., :ours_fp32.shape[-1]])
    scale = theirs_fp32.abs().max().item()
    print(f"MATRIX {version} fp16 out weights {exact:.2e} hf-vs-megatron-fp16 {fp16:.2e} "
          f"megatron-fp16-vs-fp32 {own:.2e} (max |logit| {scale:.2f})")
    assert exact <= 1e-5, f"megatron-core {version}: converted fp16 weights give logits {exact:.3g} away"
    assert fp16 <= LOW_REL["fp16"] * scale and own <= LOW_REL["fp16"] * scale, (version, fp16, own)
