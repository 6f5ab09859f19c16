"""A checkpoint written by Slipway's own training loop at (tp, pp) = (2, 2), then converted and verified.

The other parity tests write random checkpoints with the converter's own writer at every layout; this one
closes the loop with the real trainer (gloo, 4 processes): its shard layout, args, tied-head copy on the
last stage, the run's tokenizer and metrics file — through the post-job hook, as the orchestrator runs it.
"""

from __future__ import annotations

import json

from tests.train.harness import run_cfg, spawn, tiny_config, write_dataset
from trainer.convert import convert_run


def _train(rank: int, cfg: dict) -> None:
    result = run_cfg(cfg)
    assert result.exit_code == 0


def test_trained_tp2_pp2_checkpoint_converts(tmp_path, tokenizer_dir):
    data = write_dataset(str(tmp_path / "data"))
    cfg = tiny_config(str(tmp_path / "run"), data, parallel={"tp_size": 2, "pp_size": 2},
                      train={"micro_batch_size": 1, "global_batch_size": 2, "iters": 6, "eval_interval": 6,
                             "eval_iters": 1, "log_interval": 3},
                      tokenizer={"vocab_file": str(tokenizer_dir / "vocab.json"),
                                 "merge_file": str(tokenizer_dir / "merges.txt")},
                      run_id="trained-2x2")
    cfg["model"].pop("vocab_size")  # from the tokenizer: 1000, padded to 1024 at tp 2
    spawn(4, str(tmp_path), _train, cfg)
    ckpt = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in (ckpt / "iter_0000006").iterdir()) == [
        "manifest.json", "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    result = convert_run(tmp_path / "run", sample_tokens=8)  # the post-job hook on the real run dir
    assert (tmp_path / "run" / "sample.txt").is_file()
    assert result.provenance.val_loss is not None  # from the trainer's train_metrics.jsonl
    assert result.report.passed and result.report.max_abs_logit_diff <= 1e-4
    assert result.spec.padded_vocab_size == 1024 and result.spec.vocab_size == 1000
    assert result.provenance.run_id == "trained-2x2" and result.provenance.iteration == 6
    assert result.provenance.tokens_seen == 6 * 2 * 16
    config = json.loads((tmp_path / "run" / "hf" / "config.json").read_text())
    eod = json.loads((tokenizer_dir / "vocab.json").read_text())["<|endoftext|>"]
    assert config["eos_token_id"] == eod and config["vocab_size"] == 1000


def test_from_hf_checkpoint_starts_a_fine_tune(tmp_path, tokenizer_dir):
    """from_hf at tp=2 → the trainer's checkpoint.load=model-only at tp=1 (resharded) → one step → to_hf.
    Megatron's warm-up makes the first step's learning rate 0 (lr = max_lr · 0 / warmup), so the weights
    come back bit for bit: the trainer loaded exactly what the HF model had."""
    import shutil

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from trainer.convert.from_hf import FromHFConfig, convert_hf_model
    from trainer.convert.hf_io import load_weights

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_positions=16, n_embd=32, n_layer=2, n_head=4))
    hf.save_pretrained(tmp_path / "gpt2")
    for f in ("vocab.json", "merges.txt"):
        shutil.copyfile(tokenizer_dir / f, tmp_path / "gpt2" / f)
    assert convert_hf_model(FromHFConfig(tmp_path / "gpt2", tmp_path / "from_hf", tp_size=2)).passed
    data = write_dataset(str(tmp_path / "data"))
    cfg = tiny_config(str(tmp_path / "ft"), data, optim={"warmup_iters": 4},
                      train={"micro_batch_size": 1, "global_batch_size": 2, "iters": 1,
                             "eval_interval": None},
                      tokenizer={"vocab_file": str(tmp_path / "from_hf" / "tokenizer" / "vocab.json"),
                                 "merge_file": str(tmp_path / "from_hf" / "tokenizer" / "merges.txt")},
                      checkpoint={"load": "model-only", "load_dir": str(tmp_path / "from_hf")})
    cfg["model"].pop("vocab_size")
    spawn(1, str(tmp_path), _train, cfg)
    convert_run(tmp_path / "ft", sample_tokens=4)
    before, after = load_weights(tmp_path / "gpt2"), load_weights(tmp_path / "ft" / "hf")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
