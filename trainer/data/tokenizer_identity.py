"""Which tokenizer, by content: the digest that ties a run's data, its checkpoints and its converted model
to the one tokenizer they were made with.

- the preprocessing summary records the digest of the tokenizer that wrote the ``.bin``
  (``tokenizer_digest``);
- every checkpoint records the digest of the tokenizer its run trained with, in ``args`` as
  :data:`DIGEST_ARG` (an extra attribute, like ``run_id``: Megatron-LM's loaders and transformers' converter
  read their own fields by name and ignore it);
- before training the data's digest must be the run's (the training stage), before resuming the
  checkpoint's must be (the plan, and the trainer before it loads anything), and the converter ships only
  the tokenizer the checkpoint records.

A replaced vocab.json/merges.txt (or ``tokenizer.*`` pointed at other files under the same run_id) is
therefore refused with its fix instead of continuing to train on another vocabulary. Checkpoints without a
record (Megatron-LM's, or Slipway's from before) load with a note: nothing can be checked.

The digest is SHA-256 over the bytes: GPT-2 BPE's vocab and merges (by role, not by file name, so a copy
elsewhere is the same tokenizer), a Hugging Face directory's tokenizer files (``hf_tokenizer.content_hash``).
Torch-free: the orchestrator computes it at plan time.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.data.hf_tokenizer import HF_TOKENIZER_TYPE, content_hash

DIGEST_ARG = "slipway_tokenizer_digest"  # the checkpoint args' field
SUMMARY_FIELD = "tokenizer_digest"  # the preprocessing summary's field (PreprocessSummary)


def tokenizer_digest(tokenizer_type: str, vocab_file: str | None, merge_file: str | None,
                     model: str | None) -> str | None:
    """``sha256:<hex>`` of the tokenizer's content; None when it has no files to read (pre-tokenized data
    described by a vocab size only) or they cannot be read (the loader then says why)."""
    try:
        if tokenizer_type == HF_TOKENIZER_TYPE:
            return f"sha256:{content_hash(model)}" if model else None
        if not (vocab_file and merge_file):
            return None
        h = hashlib.sha256()
        for role, path in (("vocab", vocab_file), ("merges", merge_file)):
            h.update(role.encode() + b"\0" + Path(path).read_bytes() + b"\0")
        return f"sha256:{h.hexdigest()}"
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class TokenizerId:
    """A run's tokenizer: its digest (None: nothing to read) and its files (for messages)."""

    digest: str | None
    files: str


def identify(tokenizer: Any) -> TokenizerId:
    """The :class:`TokenizerId` of a tokenizer section (``TokenizerConfig`` or its dict)."""
    get = tokenizer.get if isinstance(tokenizer, dict) else lambda k: getattr(tokenizer, k, None)
    kind = get("type") or "GPT2BPETokenizer"
    files = str(get("model")) if kind == HF_TOKENIZER_TYPE else f"{get('vocab_file')} + {get('merge_file')}"
    return TokenizerId(tokenizer_digest(kind, get("vocab_file"), get("merge_file"), get("model")), files)


def short(digest: str) -> str:
    return digest.removeprefix("sha256:")[:12]


def resume_refusal(saved: str, current: TokenizerId, ckpt_dir: str, iteration: int
                   ) -> tuple[str, str] | None:
    """(what is wrong, the fix) when a run must not resume from a checkpoint whose recorded tokenizer
    digest is ``saved`` (one text: the plan and the trainer say the same); None when it may."""
    if current.digest is None or saved == current.digest:
        return None
    return (f"the checkpoint {ckpt_dir} iteration {iteration} was trained with another tokenizer (sha256 "
            f"{short(saved)}…) than this run's {current.files} (sha256 {short(current.digest)}…): resuming "
            "would continue training on another vocabulary",
            "put back the tokenizer files it was trained with; or start a new run (another run_id), from "
            "these weights with the new tokenizer by checkpoint.load=model-only "
            f"checkpoint.load_dir={ckpt_dir}")


def unrecorded_note(ckpt_dir: str, iteration: int) -> str:
    return (f"the checkpoint {ckpt_dir} iteration {iteration} records no tokenizer (written by Megatron-LM "
            "or by Slipway before checkpoints recorded it): it is loaded without checking that it was "
            "trained with this run's tokenizer")


def data_refusal(summaries: list[str], current: TokenizerId) -> str | None:
    """Why the run must not train on its data (None: it may): a preprocessing summary records another
    tokenizer than the run's (a file replaced between preprocessing and training). Summaries without a
    record (older ones) and a run without tokenizer files are not compared."""
    for path in summaries:
        try:
            recorded = json.loads(Path(path).read_text(encoding="utf-8")).get(SUMMARY_FIELD)
        except (OSError, ValueError, AttributeError):
            continue
        if recorded and current.digest and recorded != current.digest:
            return (f"the data of {path} was tokenized with another tokenizer (sha256 {short(recorded)}…) "
                    f"than this run's {current.files} (sha256 {short(current.digest)}…), which changed after "
                    f"preprocessing: delete {Path(path).parent} and launch again to tokenize the data anew")
    return None
