"""The post-job hook: convert a run's latest checkpoint into ``<run_dir>/hf/``, verify, write a sample.

The orchestrator runs :func:`convert_run` as the stage after training; the training job can call it at
its end. ``push_to_hub`` is checked before any work (:mod:`trainer.convert.hub`) so that a run never
converts for an hour and then fails at the upload.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from trainer.convert.hf_io import hf_positions
from trainer.convert.hub import check_hub, push
from trainer.convert.run_config import ConvertRunConfig
from trainer.convert.shard_io import iteration_path
from trainer.convert.to_hf import ConversionResult, ToHFConfig, convert_checkpoint
from trainer.log import get_logger
from trainer.metrics_file import VALID_LOSS, last_at_or_before
from trainer.run_files import RunDir

log = get_logger(__name__)


def write_sample(hf_dir: Path, out: Path, prompt: str, new_tokens: int, repetition_penalty: float = 1.0
                 ) -> str:
    """Greedy continuation of ``prompt`` by the converted model, loaded as users load it; the prompt is
    cut from the left (and the continuation capped) to fit the model's positions. ``repetition_penalty``
    is transformers' (CTRL's): a tiny model's plain greedy output tends to repeat one token forever."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    n_pos = hf_positions(model.config)
    new_tokens = min(new_tokens, n_pos - 1)
    ids = tok(prompt, return_tensors="pt")["input_ids"][:, -(n_pos - new_tokens):]
    with torch.no_grad():
        got = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, pad_token_id=tok.pad_token_id,
                             repetition_penalty=repetition_penalty)
    text = tok.decode(got[0])
    how = f"greedy, repetition penalty {repetition_penalty:g}" if repetition_penalty != 1.0 else "greedy"
    out.write_text(f"# sample ({how}) from {hf_dir} ({got.shape[1] - ids.shape[1]} new tokens)\n{text}\n",
                   encoding="utf-8")
    return text


def _run_info(run_dir: Path) -> dict[str, Any]:
    path = RunDir(run_dir).run_json
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        log.warning("%s is unreadable; the model card will lack the run's identity", path)
        return {}


def final_val_loss(run_dir: Path, iteration: int) -> float | None:
    """The last validation loss at or before ``iteration`` in the trainer's metrics file (Megatron's
    ``release`` is iteration 0: none)."""
    row = last_at_or_before(run_dir, VALID_LOSS, iteration)
    return float(row[VALID_LOSS]) if row is not None else None


def convert_run(run_dir: str | os.PathLike, cfg: ConvertRunConfig | None = None, **fields: Any
                ) -> ConversionResult:
    """Convert ``<run_dir>``'s latest checkpoint to ``<run_dir>/hf/`` (verified), write ``sample.txt``.

    ``fields`` override ``cfg`` (the orchestrator passes checkpoint_dir, output_dir, vocab_file, merge_file,
    tokenizer_model, verify). Raises HubUnavailable before any work, CheckpointError for a bad checkpoint, and
    VerificationFailed (output marked invalid) when the converted model does not match.
    """
    cfg = dataclasses.replace(cfg or ConvertRunConfig(), **fields)
    run = Path(run_dir)
    token = check_hub(cfg.hub_repo) if cfg.push_to_hub else None
    if not cfg.verify:
        log.warning("convert.verify=false is ignored: verification is part of conversion and always runs")
    info = _run_info(run)
    out = Path(cfg.output_dir or RunDir(run).hf)
    checkpoint_dir = Path(cfg.checkpoint_dir or RunDir(run).checkpoints)
    _, iteration = iteration_path(checkpoint_dir, cfg.iteration)
    val_loss = cfg.val_loss if cfg.val_loss is not None else final_val_loss(run, iteration)
    to_hf = ToHFConfig(
        checkpoint_dir=checkpoint_dir, output_dir=out,
        iteration=iteration,
        write_bin=cfg.write_bin, vocab_file=Path(cfg.vocab_file) if cfg.vocab_file else None,
        merge_file=Path(cfg.merge_file) if cfg.merge_file else None,
        tokenizer_model=Path(cfg.tokenizer_model) if cfg.tokenizer_model else None, overwrite=True,
        provenance={"run_id": info.get("run_id"), "val_loss": val_loss})
    result = convert_checkpoint(to_hf)
    write_sample(out, RunDir(run).sample, cfg.prompt, cfg.sample_tokens, cfg.repetition_penalty)
    if token:
        log.info("pushed %s to %s", out, push(out, cfg.hub_repo, token, cfg.hub_private))
    return result
