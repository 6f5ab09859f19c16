"""config → Plan: validation, estimates and the stage graph, as pure functions.

The stage graph is ``[corpus] → preprocess → train → convert``. Shared stages (corpus, preprocess) write
into ``<cache_dir>/<stage>/<key>/`` where the key hashes the config slice that produces the output plus
the version of the code that produces it, so a second launch over the same data finds the output complete
and skips the stage, and two sweep points needing the same key share one job. Per-run stages (train,
convert) write into the run directory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from orchestrator.checks import Context, Estimates, run_checks
from orchestrator.estimate import (
    MemoryEstimate,
    MemoryOption,
    TimeEstimate,
    estimate_memory,
    estimate_time,
)
from orchestrator.jobs import ConvertJob, CorpusJob, PreprocessJob, TrainJob
from orchestrator.layout import Layout, layout_of
from orchestrator.problems import Problem
from orchestrator.schema import SlipwayConfig
from trainer.checks import deferred
from trainer.config import RunConfig
from trainer.convert.run_config import ConvertRunConfig
from trainer.data.blend import BlendError, blend_paths
from trainer.data.hf_tokenizer import HF_TOKENIZER_TYPE
from trainer.eval.config import EvalConfig, EvalRun
from trainer.formulas import model_vocab_size
from trainer.run_files import RunDir, document_prefix


def stable_hash(obj: Any, n: int = 16) -> str:
    """Hash of a JSON-able object, independent of dict order."""
    blob = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:n]


@dataclass(frozen=True)
class SweepInfo:
    sweep_id: str
    sweep_dir: str
    point: int
    overrides: tuple[str, ...]  # the point's own overrides (what varies), e.g. ("optim.lr=1e-4",)


@dataclass(frozen=True)
class PlanInputs:
    """Facts gathered outside the pure planner (see runs.py): identity, code versions, file fingerprints."""

    run_id: str
    run_dir: str
    code_version: dict[str, str] = field(default_factory=dict)  # package path -> tree hash
    fingerprints: dict[str, str] = field(default_factory=dict)  # input path -> content hash (runs.py)
    vocab_from_file: int | None = None  # entries in tokenizer.vocab_file when readable here
    sweep: SweepInfo | None = None
    environ: dict[str, str] = field(default_factory=dict)  # the launching environment (secrets, test hooks)


@dataclass(frozen=True)
class StagePlan:
    name: str  # corpus | preprocess | train | convert
    key: str
    state_dir: str  # where _COMPLETE/_FAILED/_JOB.json go (the output dir for shared stages)
    shared: bool  # output reusable across runs (content-addressed, in the cache)
    depends_on: tuple[str, ...]
    job: Any  # CorpusJob | PreprocessJob | TrainJob | ConvertJob


@dataclass
class Plan:
    run_id: str
    run_dir: str
    experiment: str
    layout: Layout
    vocab_size: int
    memory: MemoryEstimate
    time: TimeEstimate
    stages: list[StagePlan]
    problems: list[Problem]
    sweep: SweepInfo | None = None
    warnings: list[str] = field(default_factory=list)  # said before submitting; nothing is refused
    memory_options: list[MemoryOption] = field(default_factory=list)  # memory_options()

    def stage(self, name: str) -> StagePlan:
        return next(s for s in self.stages if s.name == name)


def _cache_dir(cfg: SlipwayConfig) -> str:
    return cfg.cache_dir or os.path.join(cfg.runs_root, "_cache")


def resolve_vocab(cfg: SlipwayConfig, facts: PlanInputs) -> int:
    """The vocabulary the trainer will build (trainer.formulas.model_vocab_size); 0 when unknown here."""
    return model_vocab_size(cfg.model.vocab_size, facts.vocab_from_file or cfg.tokenizer.vocab_size) or 0


def _tokenizer_files(cfg: SlipwayConfig, corpus: StagePlan | None) -> tuple[str | None, str | None]:
    if cfg.tokenizer.type == HF_TOKENIZER_TYPE:
        return None, None
    if corpus is not None and cfg.tokenizer.vocab_file is None:
        return (os.path.join(corpus.state_dir, "vocab.json"), os.path.join(corpus.state_dir, "merges.txt"))
    return str(cfg.tokenizer.vocab_file), str(cfg.tokenizer.merge_file)


def _corpus_stage(cfg: SlipwayConfig, facts: PlanInputs) -> StagePlan | None:
    c = cfg.data.corpus
    if c is None:
        return None
    trains = cfg.tokenizer.vocab_file is None and cfg.tokenizer.type != HF_TOKENIZER_TYPE
    train_vocab = cfg.tokenizer.vocab_size if trains else None
    key = stable_hash(
        {
            "corpus": dataclasses.asdict(c),
            "vocab_size": train_vocab,
            "json_key": cfg.data.json_key,
            "code": facts.code_version.get("trainer/data"),
        }
    )
    out = os.path.join(_cache_dir(cfg), "corpus", key)
    job = CorpusJob(out, c, train_vocab, cfg.data.json_key)
    return StagePlan("corpus", key, out, True, (), job)


def _preprocess_stage(cfg: SlipwayConfig, facts: PlanInputs, corpus: StagePlan | None) -> StagePlan:
    d = cfg.data
    vocab, merges = _tokenizer_files(cfg, corpus)
    if corpus is not None:
        inputs, source_id = [os.path.join(corpus.state_dir, "corpus.jsonl")], {"corpus": corpus.key}
    else:
        inputs = d.inputs()
        source_id = {"inputs": [(p, facts.fingerprints.get(p)) for p in inputs]}
    tok, model = cfg.tokenizer, cfg.tokenizer.model
    tok_id = (
        # The directory's content hash: a tokenizer changed in place gets new data (runs.py).
        {"hf_tokenizer": (model, facts.fingerprints.get(model))} if tok.type == HF_TOKENIZER_TYPE
        else {"corpus": corpus.key}
        if corpus is not None and tok.vocab_file is None
        else {
            "vocab": (vocab, facts.fingerprints.get(vocab)),
            "merges": (merges, facts.fingerprints.get(merges)),
        }
    )
    key = stable_hash(
        {
            "source": source_id,
            "tokenizer": tok_id,
            "json_key": d.json_key,
            "append_eod": d.append_eod,
            "code": facts.code_version.get("trainer/data"),
            # Only skip changes the output (fail either writes what skip would, or nothing); keys of data
            # preprocessed before on_error existed stay valid.
            **({"on_error": "skip"} if d.on_error == "skip" else {}),
        }
    )
    out = os.path.join(_cache_dir(cfg), "preprocess", key)
    # A local run streams the job's log to the terminal (launcher), where a tqdm bar redraws in place.
    progress = "bar" if cfg.cluster.executor == "local" else "log"
    job = PreprocessJob(out, inputs, vocab, merges, d.json_key, d.append_eod, d.workers, progress, d.on_error,
                        tok.type, model if tok.type == HF_TOKENIZER_TYPE else None)
    deps = ("corpus",) if corpus is not None else ()
    return StagePlan("preprocess", key, out, True, deps, job)


def run_name(cfg: SlipwayConfig, facts: PlanInputs) -> str:
    if cfg.logging.wandb.name:
        return cfg.logging.wandb.name
    if facts.sweep and facts.sweep.overrides:
        return f"{facts.run_id}:{','.join(facts.sweep.overrides)}"
    return facts.run_id


def trainer_config(cfg: SlipwayConfig, facts: PlanInputs, prep: StagePlan) -> dict[str, Any]:
    """The dict handed to ``trainer.config.RunConfig.from_dict``: every trainer section as the user set it
    (the schema's root is RunConfig, so nothing is copied field by field), with what the plan derives put
    in: the preprocessed dataset prefixes, the tokenizer files, the run's paths and W&B names."""
    out = {f.name: dataclasses.asdict(getattr(cfg, f.name)) if dataclasses.is_dataclass(getattr(cfg, f.name))
           else getattr(cfg, f.name) for f in dataclasses.fields(RunConfig)}
    job: PreprocessJob = prep.job
    prefixes = [document_prefix(p, cfg.data.json_key) for p in job.prefixes]
    try:  # a blend's weights go with the prefixes of the same inputs (a broken blend is a plan problem)
        out["data"]["paths"] = cfg.data.blend().with_paths(prefixes).spelled()
    except BlendError:
        out["data"]["paths"] = prefixes
    out["tokenizer"].update(vocab_file=job.vocab_file, merge_file=job.merge_file)
    out["checkpoint"]["dir"] = cfg.checkpoint.dir or str(RunDir(facts.run_dir).checkpoints)
    wandb = out["logging"]["wandb"]
    wandb["group"] = wandb["group"] or (facts.sweep.sweep_id if facts.sweep else None)
    wandb["name"] = run_name(cfg, facts)
    out.update(run_dir=facts.run_dir, run_id=facts.run_id)
    return out


def _summaries(prep: StagePlan) -> list[str]:
    """The preprocessing summaries (with the skipped lines) the training job copies into the run dir."""
    return [f"{p}_summary.json" for p in prep.job.prefixes]


def _run_stages(cfg: SlipwayConfig, facts: PlanInputs, prep: StagePlan) -> list[StagePlan]:
    tcfg = trainer_config(cfg, facts, prep)
    code = facts.code_version.get("trainer")
    tkey = stable_hash(
        {
            "trainer": {k: v for k, v in tcfg.items() if k not in ("run_dir", "run_id", "logging")},
            "code": code,
        }
    )
    run = RunDir(facts.run_dir)
    stages = [
        StagePlan(
            "train",
            tkey,
            str(run.stage_state("train")),
            False,
            ("preprocess",),
            TrainJob(facts.run_dir, tcfg, _summaries(prep)),
        )
    ]
    if cfg.convert.enabled:
        ckey = stable_hash({"train": tkey, "verify": cfg.convert.verify, "code": code})
        job = ConvertJob(facts.run_dir, ConvertRunConfig(
            checkpoint_dir=tcfg["checkpoint"]["dir"], output_dir=str(run.hf),
            vocab_file=tcfg["tokenizer"]["vocab_file"], merge_file=tcfg["tokenizer"]["merge_file"],
            tokenizer_model=prep.job.tokenizer_model, verify=cfg.convert.verify,
            # The sample generated after conversion must fit the model's positions (prompt included).
            sample_tokens=max(1, min(64, cfg.model.max_position_embeddings // 4))))
        stages.append(StagePlan("convert", ckey, str(run.stage_state("convert")), False, ("train",), job))
        if cfg.eval.enabled:
            stages.append(_eval_stage(cfg, tcfg, ckey, job.config.output_dir))
    return stages


def _eval_stage(cfg: SlipwayConfig, tcfg: dict[str, Any], ckey: str, hf_dir: str) -> StagePlan:
    """HumanEval + perplexity of the converted model (afterok convert); keyed by the model and the settings
    (how many sandboxes run at once changes no result)."""
    settings = dataclasses.asdict(cfg.eval)
    key = stable_hash({"convert": ckey, "eval": {k: v for k, v in settings.items() if k != "workers"}})
    run_dir = tcfg["run_dir"]  # held-out perplexity reads the first dataset (several are merged for training)
    first = blend_paths(tcfg["data"]["paths"])[0]  # a blend's first entry is a weight
    run = RunDir(run_dir)
    with deferred():  # a refused eval section is one of the plan's problems, not an exception here
        checked = EvalConfig(**settings)
    job = EvalRun(hf_dir, str(run.eval), checked, first, cfg.data.split, cfg.model.seq_length,
                  cfg.data.json_key, run_dir, tcfg["run_id"], tcfg["logging"]["wandb"])
    return StagePlan("eval", key, str(run.stage_state("eval")), False, ("convert",), job)


# The options that trade memory for time or communication without changing the math, as
# (key, section, field, values): the dry run's table shows the run at each value it is not using, and the
# advice for a memory problem names those that would lower the total. One list for both.
MEMORY_OPTIONS = (
    ("train.recompute_granularity", "train", "recompute_granularity", ("none", "selective", "full")),
    ("optim.distributed", "optim", "distributed", (False, True)),
    ("parallel.sequence_parallel", "parallel", "sequence_parallel", (False, True)),
    ("parallel.virtual_pp_size", "parallel", "virtual_pp_size", (1, 2)),
)


def _applies(key: str, lay: Layout) -> bool:
    """Options that do nothing at this layout are not offered (no DP shards, no TP group, one stage)."""
    return {"optim.distributed": lay.dp > 1, "parallel.sequence_parallel": lay.tp > 1,
            "parallel.virtual_pp_size": lay.pp > 1}.get(key, True)


def _value_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def with_option(cfg: SlipwayConfig, section: str, fields: dict) -> SlipwayConfig:
    """``cfg`` with one section's fields changed; the plan reports the config's problems itself, so a
    config that already has some is still estimated (checks deferred, as when it was composed)."""
    with deferred():
        return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **fields)})


def memory_options(cfg: SlipwayConfig, vocab: int, lay: Layout) -> list[MemoryOption]:
    """The run at every other value of each of MEMORY_OPTIONS (one change at a time), then with all the
    memory-saving values together, each with the plan's own per-device estimate and step time."""
    step = estimate_time(cfg, vocab, lay).step_s

    def option(name: str, alt: SlipwayConfig) -> MemoryOption:
        ratio = estimate_time(alt, vocab, lay).step_s / step
        return MemoryOption(name, estimate_memory(alt, vocab, lay), ratio)

    out, lowest, saving = [], cfg, 0
    for key, section, name, values in MEMORY_OPTIONS:
        if not _applies(key, lay):
            continue
        current = getattr(getattr(cfg, section), name)
        for value in values:
            if value != current:
                out.append(option(f"{key}={_value_text(value)}", with_option(cfg, section, {name: value})))
    for key, section, name, values in MEMORY_OPTIONS[:3]:  # the three that only save memory
        best = values[-1]
        if _applies(key, lay) and getattr(getattr(cfg, section), name) != best:
            lowest, saving = with_option(lowest, section, {name: best}), saving + 1
    if saving > 1:
        out.append(option("all memory savers", lowest))
    return out


def make_plan(cfg: SlipwayConfig, facts: PlanInputs, exists: Any = os.path.exists) -> Plan:
    """Everything about a launch that can be known before submitting (no job is touched)."""
    lay = layout_of(cfg)
    vocab = resolve_vocab(cfg, facts)
    mem = estimate_memory(cfg, vocab, lay)
    est = estimate_time(cfg, vocab, lay)
    choices = memory_options(cfg, vocab, lay) if lay.dp and lay.num_microbatches else []
    estimates = Estimates(mem, est, choices) if lay.dp and lay.num_microbatches else None
    problems = run_checks(Context(cfg, facts.environ, exists, estimates), "pure")
    corpus = _corpus_stage(cfg, facts)
    prep = _preprocess_stage(cfg, facts, corpus)
    stages = ([corpus] if corpus else []) + [prep] + _run_stages(cfg, facts, prep)
    warnings = ["no eval stage: convert.enabled=false leaves no converted model to evaluate (eval=none says "
                "so without this warning)"] if cfg.eval.enabled and not cfg.convert.enabled else []
    return Plan(
        facts.run_id, facts.run_dir, cfg.experiment, lay, vocab, mem, est, stages, problems, facts.sweep,
        warnings=warnings,
        memory_options=choices,
    )
