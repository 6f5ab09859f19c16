"""The Llama options and bf16 weights both ways between Slipway and megatron-core's GPTModel, and the
options Slipway refuses, on checkpoints megatron-core itself wrote — version by version.

Llama options: rope (base 500000), RMSNorm, SwiGLU, grouped-query attention (2 KV groups for 4 heads),
no linear biases, an untied output layer.

In: GPTModel (local spec, gloo, CPU) built from the args of a Llama-style Slipway run
(checkpoint.format=mcore, 2 steps so the norms are off 1) loads each tp rank's shard with
``load_state_dict(strict=True)`` and gives Slipway's logits at tp 1 and 2 within 1e-5 (fp32). A bf16 run
(optim.distributed, so the checkpoint holds bf16 weights, as Megatron-LM's --bf16 does) loads into a
GPTModel that Megatron-LM's --bf16 would build (every parameter bf16).

Out: a Llama-style GPTModel's own weights (fp32, and --bf16) at tp 2, saved as Megatron-LM saves them
(versions.EXPORT_FORMAT), convert with ``to_hf`` to a LlamaForCausalLM whose logits (real
``transformers``) are Megatron's.

bf16 is checked twice. Exactly: the same bf16 weights upcast (Megatron's fp32 twin of the model, HF loaded
in fp32) agree within 1e-5, so loading and conversion lose nothing. And the bf16 forwards themselves:
Megatron's bf16 logits against the fp32 ones on the same weights, and HF's bf16 logits against
Megatron's bf16 ones, within 2^-5 of the largest logit (model_cases.LOW_REL: why).

Refused: GPTModels megatron-core builds on CPU with an option neither HF architecture nor Slipway's GPT
has (mixture of experts, interleaved rotary, q/k LayerNorm, a QKV-only bias), saved as Megatron-LM saves
them with the args it writes: ``to_hf`` and the trainer's ``checkpoint.load=model-only`` load path refuse
each, naming the option and the fix.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.mcore.model_cases import ITERS, LLAMA, LOW_REL, REFUSED, TOKENIZER
from tests.train.harness import tiny_config, write_dataset
from trainer.convert.reference import SlipwayGPTSource
from trainer.convert.shards import load_merged
from trainer.convert.spec import spec_from_checkpoint


def _bf16_tol(reference: torch.Tensor) -> float:
    return LOW_REL["bf16"] * reference.abs().max().item()


@pytest.fixture
def runs(model_runs) -> dict:
    """name -> the iteration folder of a trained Llama-style run written in Megatron-core names
    (model_cases.LLAMA_RUNS: tp1, tp2 in fp32; bf16 at tp 2)."""
    return {name: model_runs[f"llama_{name}"] for name in ("tp1", "tp2", "bf16")}


@pytest.fixture
def megatron(megatron_models):
    """(version, Megatron's Llama outputs, ids): conftest's one subprocess per version
    (model_cases.llama_jobs: GPTModel loads the three runs, exports its own Llama-style weights in fp32
    and bf16, and saves one model per refused option)."""
    version, out, ids = megatron_models
    return version, out / "llama", ids


def _slipway_logits(iter_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    """Slipway's own GPT on the merged checkpoint (fp32 arithmetic on the stored weights)."""
    merged = load_merged(iter_dir, ITERS)
    spec = spec_from_checkpoint(merged.args, merged.state, merged.checkpoint_version, None)
    assert spec.family == "llama" and spec.query_groups == 2 and not spec.tie_word_embeddings
    source = SlipwayGPTSource(merged.state, spec)
    return torch.stack([source.logits(row) for row in ids])


def _diff(theirs: torch.Tensor, ours: torch.Tensor) -> float:
    return (theirs[..., :ours.shape[-1]] - ours).abs().max().item()


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_gpt_model_reproduces_slipways_llama_logits(runs, megatron, tp):
    version, out, ids = megatron
    ours = _slipway_logits(runs[f"tp{tp}"], ids)
    theirs = torch.from_numpy(np.load(out / f"in_tp{tp}.npy"))
    assert theirs.shape == (2, 16, 256)
    diff = _diff(theirs, ours)
    print(f"MATRIX {version} llama in tp{tp} {diff:.2e}")
    assert diff <= 1e-5, f"megatron-core {version} tp {tp}: max |logit diff| {diff:.3g}"


def test_megatron_gpt_model_loads_slipways_bf16_checkpoint(runs, megatron):
    version, out, ids = megatron
    shard = torch.load(runs["bf16"] / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert {t.dtype for t in shard["model"].values() if torch.is_tensor(t)} == {torch.bfloat16}
    ours = _slipway_logits(runs["bf16"], ids)  # fp32 arithmetic on the bf16 weights
    exact = _diff(torch.from_numpy(np.load(out / "in_bf16_fp32.npy")), ours)
    bf16 = _diff(torch.from_numpy(np.load(out / "in_bf16.npy")), ours)
    print(f"MATRIX {version} bf16 in tp2 weights {exact:.2e} bf16-forward {bf16:.2e} "
          f"(max |logit| {ours.abs().max().item():.2f})")
    assert exact <= 1e-5, f"megatron-core {version}: the loaded bf16 weights give logits {exact:.3g} away"
    assert bf16 <= _bf16_tol(ours), f"megatron-core {version}: its bf16 forward is {bf16:.3g} from fp32"


def _to_hf(src: Path, dst: Path, dtype: torch.dtype):
    from transformers import LlamaForCausalLM

    from trainer.convert.to_hf import main

    assert main(["--checkpoint-dir", str(src), "--output-dir", str(dst)]) == 0
    hf = LlamaForCausalLM.from_pretrained(dst, torch_dtype=dtype).eval()
    c = hf.config
    theta = getattr(c, "rope_parameters", None) or {"rope_theta": c.rope_theta}  # transformers 5 / 4
    assert (c.num_key_value_heads, theta["rope_theta"], c.tie_word_embeddings) == (2, 500000, False), c
    return hf


def test_megatron_llama_weights_convert_with_to_hf(tmp_path, megatron):
    version, out, ids = megatron
    hf = _to_hf(out / "export", tmp_path / "hf", torch.float32)
    with torch.no_grad():
        ours = hf(ids).logits
    diff = _diff(torch.from_numpy(np.load(out / "export.npy")), ours)
    print(f"MATRIX {version} llama out {diff:.2e}")
    assert diff <= 1e-5, f"megatron-core {version}: HF logits differ from GPTModel's by {diff:.3g}"


def test_megatron_bf16_weights_convert_with_to_hf(tmp_path, megatron):
    version, out, ids = megatron
    hf = _to_hf(out / "export_bf16", tmp_path / "hf", torch.bfloat16)
    assert hf.config.torch_dtype == torch.bfloat16 and hf.lm_head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        ours_bf16 = hf(ids).logits.float()
        ours_fp32 = hf.float()(ids).logits  # the same (bf16-valued) weights, fp32 arithmetic
    theirs_fp32 = torch.from_numpy(np.load(out / "export_bf16_fp32.npy"))
    theirs_bf16 = torch.from_numpy(np.load(out / "export_bf16.npy"))
    exact, bf16 = _diff(theirs_fp32, ours_fp32), _diff(theirs_bf16, ours_bf16)
    own = _diff(theirs_bf16, theirs_fp32[..., :ours_fp32.shape[-1]])
    print(f"MATRIX {version} bf16 out weights {exact:.2e} hf-vs-megatron-bf16 {bf16:.2e} "
          f"megatron-bf16-vs-fp32 {own:.2e} (max |logit| {theirs_fp32.abs().max().item():.2f})")
    assert exact <= 1e-5, f"megatron-core {version}: converted bf16 weights give logits {exact:.3g} away"
    assert bf16 <= _bf16_tol(theirs_fp32), f"megatron-core {version}: HF bf16 logits {bf16:.3g} off"


def _model_only_cfg(tmp_path: Path, load_dir: Path) -> dict:
    """A Slipway run of the exported Llama shape that starts from ``load_dir``'s weights."""
    model = {**LLAMA, "hidden_size": 64, "ffn_hidden_size": 128, "seq_length": 64,
             "max_position_embeddings": 64, "vocab_size": 1024}
    return tiny_config(str(tmp_path / "run"), write_dataset(str(tmp_path / "data")), model=model,
                       tokenizer={"vocab_file": str(TOKENIZER / "vocab.json"),
                                  "merge_file": str(TOKENIZER / "merges.txt")},
                       checkpoint={"load": "model-only", "load_dir": str(load_dir)})


@pytest.mark.parametrize("option", list(REFUSED))
def test_options_slipway_lacks_are_refused_on_megatrons_own_checkpoints(tmp_path, capsys, megatron, option):
    from tests.train.test_reshard import _load
    from trainer.checkpoint.files import CheckpointError
    from trainer.convert.to_hf import main
    from trainer.parallel import ParallelState

    version, out, _ = megatron
    src = out / f"refused_{option}"
    assert main(["--checkpoint-dir", str(src), "--output-dir", str(tmp_path / "hf")]) == 2
    said = capsys.readouterr().err
    flag = "--" + option.replace("_", "-")  # the fix names Megatron-LM's flag to train without
    assert f"cannot be converted: {option}=" in said and "fix: " in said and flag in said, said
    with pytest.raises(CheckpointError, match=rf"cannot be loaded: .*{option}=.*fix: .*{flag}"):
        _load(copy.deepcopy(_model_only_cfg(tmp_path, src)), ParallelState.single())


def test_the_model_only_check_accepts_megatrons_llama(tmp_path, megatron):
    """The same load path takes the Llama export (it refuses only the options above)."""
    from tests.train.test_reshard import _load
    from trainer.parallel import ParallelState

    _, out, _ = megatron
    _load(_model_only_cfg(tmp_path, out / "export"), ParallelState.single())
