"""The tokenizer: files given as a pair or trained by the corpus stage (with a size), the files exist, and
they load the way the jobs load them (a merges file of another tokenizer is named with both files; a
Hugging Face tokenizer directory needs an eos token). The HF tokenizer's own key rules are
TokenizerConfig.problems()."""

from __future__ import annotations

import os

from orchestrator.base.plan_types import Context
from orchestrator.base.problems import Problem
from orchestrator.checks.data import missing_files
from trainer.data.hf_tokenizer import HF_TOKENIZER_TYPE


def tokenizer_source_problems(ctx: Context) -> list[Problem]:
    d, tok, out = ctx.cfg.data, ctx.cfg.tokenizer, []
    if tok.type == HF_TOKENIZER_TYPE:  # tokenizer.model's own rules are TokenizerConfig.problems()
        return out
    if (tok.vocab_file is None) != (tok.merge_file is None):
        out.append(
            Problem(
                "tokenizer_pair",
                "tokenizer.merge_file",
                tok.merge_file,
                "vocab_file and merge_file go together",
                "set both, or neither to train one",
            )
        )
    if tok.vocab_file is None and d.corpus is None:
        out.append(
            Problem(
                "tokenizer_missing",
                "tokenizer.vocab_file",
                None,
                "no tokenizer files and no corpus stage to train one on",
                "set tokenizer.vocab_file and tokenizer.merge_file (or tokenizer=codeparrot)",
            )
        )
    if tok.vocab_file is None and not tok.vocab_size:
        out.append(
            Problem(
                "vocab_size",
                "tokenizer.vocab_size",
                tok.vocab_size,
                "needed to train a tokenizer",
                "set tokenizer.vocab_size, e.g. 2048",
            )
        )
    return out


def tokenizer_file_problems(ctx: Context) -> list[Problem]:
    tok = ctx.cfg.tokenizer
    files = (
        ("tokenizer.vocab_file", tok.vocab_file),
        ("tokenizer.merge_file", tok.merge_file),
        ("tokenizer.model", tok.model and os.path.join(tok.model, "tokenizer.json")),
    )
    return missing_files(ctx, [(k, v) for k, v in files if v])


def tokenizer_problems(ctx: Context) -> list[Problem]:
    tok = ctx.cfg.tokenizer
    if tok.type == HF_TOKENIZER_TYPE:
        return _hf_tokenizer_problems(tok.model)
    if not (tok.vocab_file and tok.merge_file and os.path.isfile(tok.vocab_file)
            and os.path.isfile(tok.merge_file)):
        return []  # file_missing / tokenizer_pair say so
    from trainer.data.tokenizer import TokenizerFileError, check_pair, read_merges, read_vocab

    try:
        check_pair(read_vocab(tok.vocab_file), read_merges(tok.merge_file), tok.vocab_file, tok.merge_file)
    except TokenizerFileError as err:
        return [Problem("tokenizer_invalid", "tokenizer.merge_file", tok.merge_file, str(err),
                        "set tokenizer.vocab_file and tokenizer.merge_file to the files of one tokenizer")]
    return []


def _hf_tokenizer_problems(model_dir: str | None) -> list[Problem]:
    """Loaded as the preprocess job loads it, so a missing eos token stops the plan, not the job."""
    if not model_dir or not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        return []  # file_missing says so
    from trainer.data.hf_tokenizer import load_hf_tokenizer
    from trainer.data.tokenizer import TokenizerFileError

    try:
        load_hf_tokenizer(model_dir)
    except TokenizerFileError as err:
        return [Problem("tokenizer_invalid", "tokenizer.model", model_dir, str(err),
                        "point tokenizer.model at a tokenizer directory with an eos token")]
    return []
