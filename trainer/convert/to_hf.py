"""Slipway/Megatron checkpoint (any tp, pp) → verified Hugging Face ``GPT2LMHeadModel`` or
``LlamaForCausalLM`` directory (by the checkpoint's architecture, :mod:`trainer.convert.spec`).

    python -m trainer.convert.to_hf --checkpoint-dir D [--iteration N] --output-dir O [--format bin]
                                    [--trust-pickle] [--vocab-file V --merge-file M] [--overwrite]

Reads and merges the shards on CPU in one process, writes config.json, (sharded) model.safetensors,
generation_config.json, the run's tokenizer and a model card, then verifies the written directory against
the merged source model (``verify.py``). Everything is written into ``<output-dir>.partial`` beside the
output and renamed into place only once verified (:mod:`trainer.convert.swap`): a model already in the
output directory stays there, loadable, until its replacement passed. A failed check exits non-zero and
leaves ``<output-dir>.partial`` marked invalid: an ``INVALID`` file saying why, and no config.json, so
nothing loads it by mistake; a full disk removes it (giving the space back) and says so.
"""

from __future__ import annotations

import argparse
import errno
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer import faults
from trainer.cli import Flags, add_dataclass_args, from_args
from trainer.convert import card, hf_io, llama, names, swap
from trainer.convert.reference import make_source
from trainer.convert.shard_io import CheckpointError, iteration_path
from trainer.convert.shards import MergedCheckpoint, load_merged
from trainer.convert.spec import LLAMA, GPTSpec, arg, spec_from_checkpoint
from trainer.convert.tokenizer import AnyRunTokenizer, HFRunTokenizer, find_tokenizer, save_tokenizer
from trainer.convert.verify import VerifyConfig, VerifyReport, verify
from trainer.data.hf_tokenizer import HF_TOKENIZER_TYPE
from trainer.data.tokenizer_identity import DIGEST_ARG, short, tokenizer_digest
from trainer.disk import free_bytes, out_of_space
from trainer.disk import size as bytes_text
from trainer.log import get_logger

log = get_logger(__name__)
INVALID = swap.INVALID
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class VerificationFailed(RuntimeError):
    """The written model does not reproduce the source model; the output directory is marked invalid."""


@dataclass
class ToHFConfig:
    """One conversion to Hugging Face format."""

    checkpoint_dir: Path  # the folder with the tracker file
    output_dir: Path  # the Hugging Face folder to write
    iteration: int | None = None  # None (the default): the tracker's latest
    write_bin: bool = False  # also pytorch_model.bin (the 2022 workflow)
    trust_pickle: bool = False  # allow Megatron-LM's pickled args (runs code from the file)
    vocab_file: Path | None = None  # the run's tokenizer; default: args' paths or beside the checkpoint
    merge_file: Path | None = None  # the merges.txt that goes with vocab_file
    tokenizer_model: Path | None = None  # a HuggingFaceTokenizer directory; default: the checkpoint's args
    dtype: str = "auto"  # auto = the checkpoint's weight dtype
    max_shard_size: str = "5GB"  # largest model.safetensors shard (transformers' notation)
    overwrite: bool = False  # replace a non-empty output directory
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    provenance: dict[str, Any] = field(default_factory=dict)  # overrides, e.g. run_id, val_loss

    def __post_init__(self) -> None:
        self.checkpoint_dir, self.output_dir = Path(self.checkpoint_dir), Path(self.output_dir)
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: use auto or one of {sorted(DTYPES)}")
        if self.output_dir.resolve() == self.checkpoint_dir.resolve():
            raise ValueError("output_dir must differ from checkpoint_dir")


@dataclass
class ConversionResult:
    output_dir: Path
    spec: GPTSpec
    report: VerifyReport
    provenance: card.Provenance
    files: list[str]

    def __str__(self) -> str:
        return f"{self.output_dir}: {self.report.summary()}"


def _tokenizer(cfg: ToHFConfig, merged: MergedCheckpoint) -> AnyRunTokenizer:
    search = [cfg.checkpoint_dir / "tokenizer", cfg.checkpoint_dir, cfg.checkpoint_dir.parent / "tokenizer",
              cfg.checkpoint_dir.parent]
    tok = find_tokenizer(merged.args, search, cfg.vocab_file, cfg.merge_file, cfg.tokenizer_model)
    if tok is None:
        where = ", ".join(str(p) for p in search)
        raise CheckpointError(f"the run's tokenizer (vocab.json + merges.txt) was not found: not at the "
                              f"paths in the checkpoint's args nor in {where}; pass --vocab-file and "
                              "--merge-file (or --tokenizer-model for a HuggingFaceTokenizer)")
    stated = arg(merged.args, "vocab_size")
    if stated is not None and int(stated) != tok.size:
        raise CheckpointError(f"the checkpoint was trained with vocab_size={stated} but {tok.source} has "
                              f"{tok.size} tokens: pass the run's own tokenizer files")
    recorded, found = arg(merged.args, DIGEST_ARG), _digest(tok)
    if recorded and found and recorded != found:  # the same size, another vocabulary: never ship it
        raise CheckpointError(f"the checkpoint was trained with another tokenizer (sha256 "
                              f"{short(recorded)}…) than {tok.source} (sha256 {short(found)}…): pass the "
                              "run's own tokenizer files")
    return tok


def _digest(tok: AnyRunTokenizer) -> str | None:
    if isinstance(tok, HFRunTokenizer):
        return tokenizer_digest(HF_TOKENIZER_TYPE, None, None, str(tok.model_dir))
    return tokenizer_digest("GPT2BPETokenizer", str(tok.vocab_file), str(tok.merge_file), None)


def _write_model(cfg: ToHFConfig, merged: MergedCheckpoint, spec: GPTSpec, tok: AnyRunTokenizer, out: Path
                 ) -> list[str]:
    """Weights and configs into ``out`` (the config as ``config.json.unverified``); returns the weight
    files written."""
    dtype = next(iter(merged.state.values())).dtype
    table = llama if spec.check_family() == LLAMA else names  # the rules table's llama or GPT-2 column
    # Shapes and dtypes from the map run on meta tensors; the real tensors are made while writing.
    layout = table.megatron_to_hf({k: v.to("meta") for k, v in merged.state.items()}, spec.shapes)
    files = hf_io.save_weights(layout, lambda n: table.hf_tensor(n, merged.state, spec.shapes), out,
                               cfg.max_shard_size)
    dropout = {"hidden": arg(merged.args, "hidden_dropout", 0.1),
               "attention": arg(merged.args, "attention_dropout", 0.1)}
    config = hf_io.hf_config(spec, tok.eod_id, dropout)
    hf_io.write_config(config, dtype, out, swap.UNVERIFIED_CONFIG)
    hf_io.write_generation_config(config, out)
    return files


def _build(cfg: ToHFConfig, merged: MergedCheckpoint, spec: GPTSpec, tok: AnyRunTokenizer, out: Path
           ) -> tuple[list[str], VerifyReport, card.Provenance]:
    """Write, verify and document the model in ``out`` (its config still unverified)."""
    files = _write_model(cfg, merged, spec, tok, out)
    config = hf_io.read_config(out / swap.UNVERIFIED_CONFIG)
    hf_tok = save_tokenizer(tok, out, spec.max_position_embeddings, config)
    faults.at("convert:written")
    report = verify(make_source(merged.state, spec), out, hf_tok, cfg.verify, config)
    if cfg.write_bin and report.passed:  # written from the verified safetensors: the same weights
        torch.save(hf_io.load_weights(out), out / hf_io.BIN_SINGLE)
        files.append(hf_io.BIN_SINGLE)
    prov = card.Provenance.from_args(merged.args, iteration=merged.iteration, source=str(cfg.checkpoint_dir),
                                     tp_size=merged.tp_size, pp_size=merged.pp_size, **cfg.provenance)
    dtype = str(next(iter(merged.state.values())).dtype).removeprefix("torch.")
    card.write_card(out, card.render_card(spec, prov, report, {"dtype": dtype, "eos/bos/pad id": str(
        tok.eod_id)}))
    return files, report, prov


def _disk_full(err: BaseException, partial: Path, out: Path, merged: MergedCheckpoint) -> OSError:
    """The error of a conversion that ran out of space (its partial folder is already gone)."""
    need = sum(t.numel() * t.element_size() for t in merged.state.values())
    kept = f"the model in {out} is unchanged" if out.exists() else f"nothing was written to {out}"
    free = bytes_text(free_bytes(str(out)))
    return OSError(errno.ENOSPC, f"disk full: converting into {partial} ran out of space ({err}); {kept}. "
                   f"Free at least {bytes_text(need)} on that filesystem (now {free} free) and convert again")


def convert_checkpoint(cfg: ToHFConfig) -> ConversionResult:
    """Convert, verify and document one checkpoint beside the output, then swap it in; raises
    VerificationFailed if the check fails (the output directory is left as it was)."""
    iter_dir, iteration = iteration_path(cfg.checkpoint_dir, cfg.iteration)
    log.info("reading %s", iter_dir)
    merged = load_merged(iter_dir, iteration, cfg.trust_pickle)
    tok = _tokenizer(cfg, merged)
    spec = spec_from_checkpoint(merged.args, merged.state, merged.checkpoint_version, tok.size)
    if cfg.dtype != "auto":
        merged.state = {k: v.to(DTYPES[cfg.dtype]) for k, v in merged.state.items()}
    log.info("merged tp=%d pp=%d: %d layers, hidden %d, vocab %d (padded %d)", merged.tp_size,
             merged.pp_size, spec.num_layers, spec.hidden_size, spec.vocab_size, spec.padded_vocab_size)
    out = cfg.output_dir
    partial = swap.partial_dir(out)
    try:
        swap.begin(out, cfg.overwrite)
        files, report, prov = _build(cfg, merged, spec, tok, partial)
    except BaseException as e:
        shutil.rmtree(partial, ignore_errors=True)  # nothing half-written stays; a full disk gets space back
        if out_of_space(e):
            raise _disk_full(e, partial, out, merged) from e
        raise
    if not report.passed:
        swap.mark_invalid(partial, report.summary())
        raise VerificationFailed(f"{partial}: {report.summary()}; the directory is marked {INVALID} and "
                                 f"{out} is left as it was")
    swap.mark_verified(partial)
    swap.commit(partial, out)
    log.info("wrote %s (%s)", out, ", ".join(files))
    return ConversionResult(out, spec, report, prov, files)


# write_bin is --format bin and verify's prompts are --prompt (the older command line); provenance is the
# post-job hook's.
FLAGS = (Flags(ToHFConfig, skip=frozenset({"write_bin", "verify", "provenance"}),
               options={"dtype": {"choices": ("auto", *DTYPES)}}),)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.convert.to_hf", description=__doc__.split("\n")[0])
    add_dataclass_args(p, FLAGS[0])
    p.add_argument("--format", choices=["safetensors", "bin"], default="safetensors",
                   help="bin: also write pytorch_model.bin")
    p.add_argument("--prompt", action="append",
                   help="verification prompt (repeatable; default: a built-in set)")
    p.add_argument("--push-to-hub", metavar="REPO", help="upload the verified folder to this Hub repository")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    verify_cfg = VerifyConfig(prompts=tuple(a.prompt)) if a.prompt else VerifyConfig()
    from trainer.convert.hub import HubUnavailable, check_hub, push

    try:
        token = check_hub(a.push_to_hub) if a.push_to_hub else None  # before any work
        cfg = from_args(FLAGS[0], a, write_bin=a.format == "bin", verify=verify_cfg)
        result = convert_checkpoint(cfg)
        if token:
            sys.stdout.write(f"pushed: {push(result.output_dir, a.push_to_hub, token, private=True)}\n")
    except (CheckpointError, FileExistsError, HubUnavailable, ValueError) as e:
        sys.stderr.write(f"to_hf: error: {e}\n")
        return 2
    except OSError as e:
        if not out_of_space(e):
            raise
        sys.stderr.write(f"to_hf: error: {e}\n")
        return 2
    except VerificationFailed as e:
        sys.stderr.write(f"to_hf: {e}\n")
        return 3
    sys.stdout.write(f"{result.output_dir}: {result.report.summary()}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
