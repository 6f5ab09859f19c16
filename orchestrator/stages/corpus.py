"""The corpus stage (``data.corpus``): a JSONL corpus built from source files, and the BPE trained on it
when the config names no tokenizer files. Shared: keyed by the corpus section, the vocabulary it trains
and the data code, in ``<cache>/corpus/<key>/``."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from orchestrator.stages.base import NodeStage, PlanContext, StageDef, StagePlan, stable_hash
from trainer.config import CorpusConfig
from trainer.data.hf_tokenizer import HF_TOKENIZER_TYPE
from trainer.run_files import CORPUS_FILE

NAME = "corpus"


@dataclass
class CorpusJob:
    output_dir: str
    corpus: CorpusConfig  # the data.corpus section itself (trainer/data/corpus_config.py)
    vocab_size: int | None  # train a BPE of this size on the corpus when set
    json_key: str


def trains_tokenizer(ctx: PlanContext) -> bool:
    """The corpus stage trains the BPE when the config names no vocabulary files of its own."""
    tok = ctx.cfg.tokenizer
    return ctx.cfg.data.corpus is not None and tok.vocab_file is None and tok.type != HF_TOKENIZER_TYPE


class CorpusStage(NodeStage):
    def run(self) -> dict[str, Any]:
        from trainer.data.corpus import build_corpus

        job: CorpusJob = self.job
        corpus = os.path.join(job.output_dir, CORPUS_FILE)
        summary = build_corpus(job.corpus, corpus)
        out: dict[str, Any] = {"corpus": corpus, "files": summary.files, "bytes": summary.bytes}
        if job.vocab_size:
            out.update(_train_tokenizer(corpus, job))
        return out


def _train_tokenizer(corpus: str, job: CorpusJob) -> dict[str, Any]:
    from trainer.data.train_tokenizer import TokenizerTrainConfig, train_tokenizer

    settings = TokenizerTrainConfig(inputs=[corpus], output_dir=job.output_dir,
                                    vocab_size=int(job.vocab_size or 0), json_key=job.json_key)
    vocab, merges = train_tokenizer(settings)
    return {"vocab_file": str(vocab), "merge_file": str(merges)}


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
        return StagePlan(NAME, key, out, True, (), CorpusJob(out, c, train_vocab, ctx.cfg.data.json_key))


STAGE = Corpus()
