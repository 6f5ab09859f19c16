"""The corpus stage (``data.corpus``): a JSONL corpus built from source files, and the BPE trained on it
when the config names no tokenizer files. Shared: keyed by the corpus section, the vocabulary it trains
and the data code, in ``<cache>/corpus/<key>/``. Its job is the trainer's own
:class:`~trainer.data.corpus_config.CorpusRun`."""

from __future__ import annotations

import dataclasses
from typing import Any

from orchestrator.base.plan_types import StagePlan
from orchestrator.stages.base import NodeStage, PlanContext, StageDef, stable_hash
from trainer.data.corpus_config import CorpusRun
from trainer.data.hf_tokenizer import HF_TOKENIZER_TYPE

NAME = "corpus"


def trains_tokenizer(ctx: PlanContext) -> bool:
    """The corpus stage trains the BPE when the config names no vocabulary files of its own."""
    tok = ctx.cfg.tokenizer
    return ctx.cfg.data.corpus is not None and tok.vocab_file is None and tok.type != HF_TOKENIZER_TYPE


class CorpusStage(NodeStage):
    def run(self) -> dict[str, Any]:
        from trainer.data.corpus import run_corpus

        return run_corpus(self.job)


class Corpus(StageDef):
    name = NAME
    node = CorpusStage

    def plan(self, ctx: PlanContext) -> StagePlan | None:
        c = ctx.cfg.data.corpus
        if c is None:
            return None
        train_vocab = ctx.cfg.tokenizer.vocab_size if trains_tokenizer(ctx) else None
        key = stable_hash({"corpus": dataclasses.asdict(c), "vocab_size": train_vocab,
                           "json_key": ctx.cfg.data.json_key, "code": ctx.code("trainer/data")})
        out = ctx.shared_dir(NAME, key)
        return StagePlan(NAME, key, out, True, (), CorpusRun(out, c, train_vocab, ctx.cfg.data.json_key))


STAGE = Corpus()
