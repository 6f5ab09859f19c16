"""Megatron-LM's own training-side code against Slipway, for the versions whose wheel ships it
(``megatron.training``, from 0.17: versions.HAS_TRAINING). There every job of test_model and test_llama
already goes through Megatron-LM's parser, ``get_model``, ``load_checkpoint(strict=True)`` and
``save_checkpoint`` (model_cases.Jobs); this module checks what only that path shows:

- Slipway's ``args`` are what Megatron-LM's own parser gives for the same model: every field both have,
  read back from the args of each load (the run's training settings and Slipway's own records aside);
- Megatron-LM's uneven pipeline splits (``--decoder-first-pipeline-num-layers``, and
  ``--decoder-last-pipeline-num-layers``): a 3-layer model saved by ``save_checkpoint`` on 2 stages as 1 + 2
  or 2 + 1 converts with ``to_hf`` to the logits Megatron computed across its two stages, Megatron-LM loads
  Slipway's runs of either split, and the 1 + 2 save starts a Slipway run at its own layout and at others.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.mcore.model_cases import (
    DIST_LAYOUTS,
    EXPORT_GPT,
    FIXTURES,
    ITERS,
    UNEVEN,
    UNEVEN_SPLITS,
    slipway_args,
)
from tests.mcore.versions import HAS_TRAINING
from tests.train.harness import spawn, tiny_config, write_dataset

# Fields of Slipway's args that are the run's training settings or Slipway's own records, which the
# comparison's command line does not give (it describes the model): Megatron-LM holds its defaults there.
RUN_FIELDS = {"consumed_train_samples", "consumed_valid_samples", "micro_batch_size", "global_batch_size",
              "train_iters", "lr", "min_lr", "lr_decay_style", "lr_warmup_iters", "lr_decay_iters",
              "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad", "seed", "data_path",
              "split", "use_distributed_optimizer", "world_size", "data_parallel_size",
              # Megatron's parser leaves vocab_size None with a --vocab-file (its --vocab-size is for
              # tokenizers without one) and reads it from no checkpoint; Slipway records the tokenizer's
              # size there for its converters (docs/megatron.md).
              "vocab_size"}
# Loads at another tp than the save (torch_dist): the layout is the load's, not the checkpoint's.
LAYOUT_FIELDS = {"tensor_model_parallel_size", "padded_vocab_size"}
LOADS = {"gpt": ["in_tp1", "in_tp2", "in_fp16", *(f"in_{n}" for n in UNEVEN_SPLITS),
                *(f"dist_s{s}_m{m}" for s, m in DIST_LAYOUTS)],
         "llama": ["in_tp1", "in_tp2", "in_bf16"]}
RUN_OF = {"in_tp1": "mcore1", "in_tp2": "mcore2", "in_fp16": "gpt_fp16",
          **{f"in_{n}": n for n in UNEVEN_SPLITS},
          **{f"dist_s{s}_m{m}": f"dist{s}" for s, m in DIST_LAYOUTS}}


# Only the versions with Megatron-LM's training side: conftest.py deselects the others' items (their
# mcore_version parameters stay those of every oracle module, so all share one instance per version).
ONLY_VERSIONS = HAS_TRAINING


@pytest.fixture
def megatron_lm(megatron_models):
    return megatron_models


def _differences(saved, theirs: dict, skip: set[str]) -> dict:
    out = {}
    for name, value in vars(saved).items():
        if name in skip or name not in theirs:
            continue
        mine = f"torch.{value}" if name == "params_dtype" else value
        if isinstance(mine, float) or isinstance(theirs[name], float):
            same = mine is not None and theirs[name] is not None and float(mine) == float(theirs[name])
        else:
            same = mine == theirs[name]
        if not same:
            out[name] = (value, theirs[name])
    return out


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_slipways_args_are_what_megatron_lms_parser_gives(model_runs, megatron_lm, family):
    """load_checkpoint(strict=True) accepted every run (check_checkpoint_args: add_position_embedding,
    the shape, the vocabulary, the layout), and beyond what it compares, every field Slipway writes that
    Megatron-LM's args also have equals the parser's value for the same model (model_cases'
    megatron_lm_argv: the flags a user would pass)."""
    version, out, _ = megatron_lm
    compared = 0
    for name in LOADS[family]:
        read = json.loads((out / family / f"{name}.json").read_text())
        assert read["iteration"] == ITERS, (name, read)
        run = RUN_OF[name] if family == "gpt" else f"llama_{name.removeprefix('in_')}"
        skip = RUN_FIELDS | (LAYOUT_FIELDS if name.startswith("dist") else set())
        saved = slipway_args(model_runs[run])
        wrong = _differences(saved, read["fields"], skip)
        assert not wrong, f"megatron-core {version} {family} {name}: (Slipway, Megatron-LM) {wrong}"
        compared += len(set(vars(saved)) & set(read["fields"]) - skip)
    print(f"MATRIX {version} args {family}: {compared} fields equal over {len(LOADS[family])} loads")
    assert compared > 20 * len(LOADS[family])


def _slipway_logits(iter_dir, ids) -> torch.Tensor:
    """Slipway's own GPT (fp32) on a checkpoint's merged weights."""
    from trainer.convert.reference import SlipwayGPTSource
    from trainer.convert.shards import load_merged
    from trainer.convert.spec import spec_from_checkpoint

    merged = load_merged(iter_dir, int(iter_dir.name.removeprefix("iter_")))
    spec = spec_from_checkpoint(merged.args, merged.state, merged.checkpoint_version, None)
    return torch.stack([SlipwayGPTSource(merged.state, spec).logits(row) for row in ids])


# Each split's stages as Megatron numbers them: the layers each holds, numbered from 0 on every stage.
STAGE_LAYERS = {"uneven": [["0"], ["0", "1"]], "uneven_last": [["0", "1"], ["0"]]}


@pytest.mark.parametrize("split", list(UNEVEN_SPLITS))
def test_megatron_lm_loads_slipways_uneven_run_at_its_layout(model_runs, megatron_lm, split):
    """A Slipway run at pp=2 with parallel.first_stage_layers=1 (3 layers as 1 + 2), or last_stage_layers=1
    (2 + 1): Megatron-LM's load_checkpoint (strict, --pipeline-model-parallel-size 2 and
    --decoder-first-pipeline-num-layers 1 or --decoder-last-pipeline-num-layers 1) fills its two stages,
    and their logits are Slipway's."""
    version, out, ids = megatron_lm
    diff = _diff(out / "gpt" / f"in_{split}.npy", _slipway_logits(model_runs[split], ids))
    print(f"MATRIX {version} {split} in pp2 {diff:.2e}")
    assert diff <= 1e-5, f"megatron-core {version}: logits {diff:.3g} from Slipway's"


@pytest.mark.parametrize("split", list(UNEVEN_SPLITS))
def test_megatron_lms_uneven_pipeline_checkpoint_converts(tmp_path, megatron_lm, split):
    """--pipeline-model-parallel-size 2 with --decoder-first-pipeline-num-layers 1 (stage 0 holds layer 0,
    stage 1 layers 1-2) or --decoder-last-pipeline-num-layers 1 (layers 0-1, then 2), on 3 layers, each
    stage numbered from 0 (mp_rank_00_000, mp_rank_00_001); to_hf gives the logits Megatron computed
    across its two stages."""
    from transformers import GPT2LMHeadModel

    from trainer.checkpoint import pickles
    from trainer.convert.to_hf import main

    version, out, ids = megatron_lm
    iter_dir = out / "gpt" / split / "iter_0000005"
    stages = [pickles.load(str(iter_dir / f"mp_rank_00_00{p}" / "model_optim_rng.pt")) for p in range(2)]
    layers = [sorted({k.split(".")[2] for k in s["model"] if k.startswith("decoder.layers.")})
              for s in stages]
    assert layers == STAGE_LAYERS[split], layers
    for field, value in UNEVEN_SPLITS[split].items():  # first_stage_layers: decoder_first_pipeline_num_layers
        megatron = f"decoder_{field.removesuffix('_stage_layers')}_pipeline_num_layers"
        assert getattr(stages[0]["args"], megatron) == value, (megatron, stages[0]["args"])
    assert main(["--checkpoint-dir", str(out / "gpt" / split), "--output-dir", str(tmp_path / "hf")]) == 0
    with torch.no_grad():
        ours = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()(ids).logits
    diff = _diff(out / "gpt" / f"{split}.npy", ours)
    print(f"MATRIX {version} {split} out {diff:.2e}")
    assert diff <= 1e-5, f"megatron-core {version}: HF logits {diff:.3g} from Megatron's two stages"


def _diff(megatron_npy, ours: torch.Tensor) -> float:
    return (torch.from_numpy(np.load(megatron_npy))[..., :ours.shape[-1]] - ours).abs().max().item()


def _train(rank: int, cfg: dict) -> None:
    from tests.mcore.model_cases import train

    train(rank, cfg)


def test_megatron_lms_uneven_checkpoint_starts_a_slipway_run(tmp_path, megatron_lm):
    """checkpoint.load=model-only from the uneven save at its own layout (pp 2, the first stage holding 1
    layer: parallel.first_stage_layers=1), and for the newest version at pp 1 and 3 too (the checkpoint
    format is the same in every version; each layout costs a run); one step at learning rate 0
    (warm-up), so each run's checkpoint still computes Megatron's logits (Slipway's own GPT on it: the
    conversion is the test above's)."""
    version, out, ids = megatron_lm
    tok = FIXTURES / "tokenizer"
    newest = version == max(HAS_TRAINING, key=_key)
    layouts = [(2, UNEVEN["first"])] + ([(1, None), (3, None)] if newest else [])
    for pp, first in layouts:
        run = tmp_path / f"run_pp{pp}"
        cfg = tiny_config(str(run), write_dataset(str(tmp_path / "data")),
                          model={**EXPORT_GPT, "num_layers": UNEVEN["layers"], "vocab_size": 1024,
                                 "hidden_dropout": 0.0, "attention_dropout": 0.0},
                          parallel={"tp_size": 1, "pp_size": pp, "first_stage_layers": first},
                          optim={"warmup_iters": 4},
                          train={"micro_batch_size": 1, "global_batch_size": 2, "iters": 1,
                                 "eval_interval": None},
                          tokenizer={"vocab_file": str(tok / "vocab.json"),
                                     "merge_file": str(tok / "merges.txt")},
                          checkpoint={"load": "model-only", "load_dir": str(out / "gpt" / "uneven")})
        spawn(pp, str(tmp_path), _train, cfg)
        diff = _diff(out / "gpt" / "uneven.npy", _slipway_logits(run / "checkpoints" / "iter_0000001", ids))
        print(f"MATRIX {version} uneven run-start pp{pp} {diff:.2e}")
        assert diff <= 1e-5, f"megatron-core {version}: the pp={pp} run's weights give logits {diff:.3g} away"


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("."))
