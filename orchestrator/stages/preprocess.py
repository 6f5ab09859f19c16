"""The preprocess stage: each input JSONL (or the corpus stage's) tokenized into Megatron's ``.bin/.idx``.
Shared: keyed by the inputs' content, the tokenizer, the data settings and the data code, in
``<cache>/preprocess/<key>/``. Its job is the trainer's own :class:`PreprocessConfig`, one per input."""

from __future__ import annotations

import os
from typing import Any

from orchestrator.base.plan_types import StagePlan
from orchestrator.base.schema import SlipwayConfig
from orchestrator.stages import corpus
from orchestrator.stages.base import STAGE_MEM_GB, NodeStage, PlanContext, StageDef, stable_hash
from trainer.config_issues import deferred
from trainer.data.hf_tokenizer import HF_TOKENIZER_TYPE
from trainer.data.preprocess import PreprocessConfig
from trainer.run_files import CORPUS_FILE, MERGE_FILE, VOCAB_FILE, preprocess_prefixes, preprocess_summary

NAME = "preprocess"


def prefixes(job: list[PreprocessConfig]) -> list[str]:
    """The output prefixes, one per input (``data``, or ``data0``, ``data1``...)."""
    return [c.output_prefix for c in job]


def summaries(job: list[PreprocessConfig]) -> list[str]:
    """The preprocessing summaries (with the skipped lines) the training job copies into the run dir."""
    return [preprocess_summary(c.output_prefix) for c in job]


class PreprocessStage(NodeStage):
    def run(self) -> dict[str, Any]:
        from trainer.data.preprocess import PreprocessError, preprocess

        job: list[PreprocessConfig] = self.job
        try:
            return {"prefixes": prefixes(job), "summaries": [str(preprocess(c)) for c in job]}
        except PreprocessError as err:  # its fix in the launcher's words, not the preprocessing tool's flag
            raise PreprocessError(err.bad, skip="data.on_error=skip") from None


def tokenizer_files(ctx: PlanContext) -> tuple[str | None, str | None]:
    """The vocab and merges the data is tokenized with: the config's, or those the corpus stage trains."""
    cfg, built = ctx.cfg, ctx.planned.get(corpus.NAME)
    if cfg.tokenizer.type == HF_TOKENIZER_TYPE:
        return None, None
    if built is not None and corpus.trains_tokenizer(ctx):
        return os.path.join(built.state_dir, VOCAB_FILE), os.path.join(built.state_dir, MERGE_FILE)
    return str(cfg.tokenizer.vocab_file), str(cfg.tokenizer.merge_file)


def _tokenizer_id(ctx: PlanContext, vocab: str | None, merges: str | None) -> dict[str, Any]:
    """What identifies the tokenizer in the key: a HF directory's content hash (a tokenizer changed in place
    gets new data, runs.py), the corpus stage's key when it trains the BPE, else the two files' hashes."""
    tok, prints, built = ctx.cfg.tokenizer, ctx.facts.fingerprints, ctx.planned.get(corpus.NAME)
    if tok.type == HF_TOKENIZER_TYPE:
        return {"hf_tokenizer": (tok.model, prints.get(tok.model))}
    if built is not None and corpus.trains_tokenizer(ctx):
        return {"corpus": built.key}
    return {"vocab": (vocab, prints.get(vocab)), "merges": (merges, prints.get(merges))}


class Preprocess(StageDef):
    name = NAME
    after = (corpus.NAME,)
    node = PreprocessStage

    def plan(self, ctx: PlanContext) -> StagePlan:
        d, built = ctx.cfg.data, ctx.planned.get(corpus.NAME)
        vocab, merges = tokenizer_files(ctx)
        if built is not None:
            inputs, source_id = [os.path.join(built.state_dir, CORPUS_FILE)], {"corpus": built.key}
        else:
            inputs = d.inputs()
            source_id = {"inputs": [(p, ctx.facts.fingerprints.get(p)) for p in inputs]}
        key = stable_hash({
            "source": source_id, "tokenizer": _tokenizer_id(ctx, vocab, merges), "json_key": d.json_key,
            "append_eod": d.append_eod, "code": ctx.code("trainer/data"),
            # Only skip changes the output (fail either writes what skip would, or nothing); keys of data
            # preprocessed before on_error existed stay valid.
            **({"on_error": "skip"} if d.on_error == "skip" else {}),
        })
        out = ctx.shared_dir(NAME, key)
        with deferred():  # the files are checked where the job runs (the corpus stage's do not exist yet)
            job = [self._config(ctx, inp, prefix, vocab, merges)
                   for inp, prefix in zip(inputs, preprocess_prefixes(out, len(inputs)), strict=True)]
        return StagePlan(NAME, key, out, True, (corpus.NAME,) if built is not None else (), job)

    def mem_gb(self, cfg: SlipwayConfig) -> float:
        """Each worker holds its own tokenizer and batch of documents: about 90 MB each with an 8k BPE
        vocabulary on the stdlib corpus (measured: 4 workers, 474 MB in all); 0.5 GB each leaves room for
        GPT-2's vocabulary and long documents."""
        return STAGE_MEM_GB + 0.5 * max(cfg.data.workers, 1)

    @staticmethod
    def _config(ctx: PlanContext, inp: str, prefix: str, vocab: str | None, merges: str | None
                ) -> PreprocessConfig:
        d, tok = ctx.cfg.data, ctx.cfg.tokenizer
        # A local run streams the job's log to the terminal (launcher), where a tqdm bar redraws in place.
        progress = "bar" if ctx.cfg.cluster.executor == "local" else "log"
        return PreprocessConfig(
            input=inp, output_prefix=prefix, vocab_file=vocab, merge_file=merges, json_keys=[d.json_key],
            tokenizer_type=tok.type, tokenizer_model=tok.model if tok.type == HF_TOKENIZER_TYPE else None,
            append_eod=d.append_eod, workers=max(d.workers, 1), on_error=d.on_error, progress=progress)


STAGE = Preprocess()
