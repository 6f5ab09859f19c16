"""The configuration, defined once: one small dataclass per section (``model``/``parallel`` in
:mod:`trainer.config.model`, ``train``/``optim`` in :mod:`trainer.config.train`, the rest here), and
``RunConfig`` tying them.

These classes are the single definition of every trainer setting, its type, its default and its rules.
The Hydra schema (orchestrator/base/schema.py) is built from them (it adds only the orchestrator's own
sections), users' YAML files use their names (``model.hidden_size``, ``optim.lr`` ...), and
``python -m orchestrator.docs`` renders the string literal under each field (an attribute docstring) into
``docs/config.md``. The module imports no torch (the login node composes configs in a second).

Each class lists its own invariants in ``problems()`` (:mod:`trainer.config_issues`) and ``__post_init__``
raises them all; checks that need several sections or the world size (heads % tp, batch divisibility)
live in ``trainer.run`` and orchestrator/checks/. Functions receive the slice they need, never
the root.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from typing import Any

from trainer.config.model import ATTENTION_BACKENDS, ModelConfig, ParallelConfig
from trainer.config.train import (
    DECAY_STYLES,
    OPTIM_IMPLS,
    PRECISION_RECIPES,
    PRECISIONS,
    OptimConfig,
    TrainConfig,
    precision_recipe,
)
from trainer.config_issues import ConfigIssue, Section, choice, issue, positive
from trainer.data.blend import Blend, BlendError, blend_paths, parse_blend
from trainer.data.corpus_config import CorpusConfig
from trainer.data.hf_tokenizer import HF_TOKENIZER_TYPE, TOKENIZER_TYPES
from trainer.data.preprocess_io import ON_ERROR
from trainer.data.splits import DEFAULT_SPLIT, parse_split
from trainer.log import get_logger
from trainer.run_files import DEFAULT_JSON_KEY, RunDir

log = get_logger(__name__)

__all__ = ["CheckpointConfig", "CorpusConfig", "DataConfig", "LoggingConfig", "ModelConfig",
           "OptimConfig", "ParallelConfig", "RunConfig", "TokenizerConfig", "TrainConfig", "WandbConfig",
           "ATTENTION_BACKENDS", "PRECISIONS", "DECAY_STYLES", "OPTIM_IMPLS", "WANDB_MODES", "ON_ERROR"]

WANDB_MODES = ("online", "offline", "disabled")
CHECKPOINT_FORMATS = ("legacy", "mcore", "torch_dist")
KERNEL_SETS = ("auto", "csrc", "apex", "eager", "compile", "compile_layer")
# The settings that mean the compiled kernels: a CUDA run with one of them refuses to start without them
# (trainer/run/kernels.py), and the plan checks a GPU run's image has them (orchestrator/checks/container.py).
COMPILED_KERNEL_SETS = ("auto", "csrc", "apex")


@dataclass
class DataConfig(Section):
    """Training text, its preprocessing into Megatron ``.bin/.idx`` (cached by content), and its split."""

    paths: list[str] = field(default_factory=list)
    """JSONL files (one document per line, .gz allowed) to preprocess; ignored when corpus is set. The
    trainer reads dataset prefixes: the full prefix (corpus_content_document) or the preprocess output
    prefix (corpus), to which _{json_key}_document is appended. Several paths are concatenated into one
    dataset; weight/path pairs, Megatron's --data-path spelling ([0.3,/data/a.jsonl,0.7,/data/b.jsonl]),
    are a weighted blend with megatron-core's BlendedDataset order: weights normalised, each corpus split
    by data.split on its own and drawn in proportion."""
    json_key: str = DEFAULT_JSON_KEY
    """The JSON field that holds each document's text."""
    split: str = DEFAULT_SPLIT
    """Relative weights of the train, validation and test documents (Megatron's split string)."""
    append_eod: bool = True
    """Append <|endoftext|> to every document (preprocessing)."""
    workers: int = 2
    """Tokenizer worker processes of the preprocessing job."""
    on_error: str = "fail"
    """Bad JSONL lines (invalid JSON or UTF-8, missing or non-string key): fail stops the preprocessing
    job at the first one, naming file:line (training never starts); skip drops them, counts them by reason
    and copies the report (file:line of each) to <run_dir>/data_report.json."""
    corpus: CorpusConfig | None = None
    """Build the corpus on the cluster (see data.corpus); null: read paths."""
    cache_dir: str | None = None
    """Where the trainer caches the sample/shuffle indices and a blend's indices (Megatron's
    --data-cache-path); null: index-cache/ next to the (first) dataset."""

    def _normalise(self) -> None:
        if isinstance(self.paths, str):
            self.paths = [self.paths]
        self.paths = [str(p) for p in self.paths]
        if isinstance(self.corpus, dict):
            self.corpus = _build(CorpusConfig, self.corpus, "data.corpus")

    def inputs(self) -> list[str]:
        """The files (or prefixes) of ``paths``, without a blend's weights."""
        return blend_paths(self.paths)

    def blend(self) -> Blend:
        """``paths`` read as Megatron reads --data-path (raises ValueError; ``problems`` reports it)."""
        return parse_blend(self.paths)

    def problems(self) -> list[ConfigIssue]:
        out = choice("data.on_error", self.on_error, ON_ERROR) + positive("data.workers", self.workers)
        if self.corpus is not None:
            out += self.corpus.problems()
        try:
            self.blend()
        except BlendError as err:
            out.append(issue("blend", "data.paths", self.paths, err.message, err.fix))
        try:
            parse_split(str(self.split))
        except ValueError as err:
            out.append(issue("split", "data.split", self.split, str(err).split(": ", 1)[-1],
                             "e.g. data.split='969,30,1'"))
        return out


@dataclass
class TokenizerConfig(Section):
    """Existing GPT-2 BPE files, a Hugging Face tokenizer directory (type=HuggingFaceTokenizer), or (files
    and model null) a GPT-2 BPE trained on the corpus by the corpus stage."""

    vocab_file: str | None = None
    """GPT-2 BPE vocab.json; null (with merge_file null): train one in the corpus stage."""
    merge_file: str | None = None
    """GPT-2 BPE merges.txt that goes with vocab_file."""
    type: str = "GPT2BPETokenizer"
    """Megatron's tokenizer type: GPT2BPETokenizer (vocab_file + merge_file) or HuggingFaceTokenizer
    (model)."""
    model: str | None = None
    """HuggingFaceTokenizer: a directory holding a tokenizer.json (Megatron's --tokenizer-model), loaded
    with transformers.AutoTokenizer. Its len(tokenizer) is the vocabulary (padded as for GPT-2), its
    eos token the end-of-document id, and its files are copied into the converted hf/ folder."""
    vocab_size: int | None = None
    """Without files: the size of the vocabulary to train (and of pre-tokenized data's vocabulary). With
    files: used only by the plan's memory table while vocab_file is not readable from the login node
    (the file wins when it is); model.vocab_size wins over both."""

    def problems(self) -> list[ConfigIssue]:
        out = (choice("tokenizer.type", self.type, TOKENIZER_TYPES)
               + positive("tokenizer.vocab_size", self.vocab_size, allow_none=True))
        hf = self.type == HF_TOKENIZER_TYPE
        if hf and not self.model:
            out.append(issue("required", "tokenizer.model", self.model, "HuggingFaceTokenizer reads its "
                             "tokenizer.json from this directory", "tokenizer.model=/path/to/tokenizer_dir"))
        if hf and (self.vocab_file or self.merge_file):
            out.append(issue("conflict", "tokenizer.vocab_file", self.vocab_file, "HuggingFaceTokenizer "
                             "reads tokenizer.model, not GPT-2 BPE files", "set tokenizer.vocab_file=null "
                             "and tokenizer.merge_file=null"))
        if self.model and not hf:
            out.append(issue("conflict", "tokenizer.model", self.model, f"is read only with "
                             f"type=HuggingFaceTokenizer (type is {self.type})",
                             "set tokenizer.type=HuggingFaceTokenizer, or tokenizer.model=null"))
        return out


@dataclass
class CheckpointConfig(Section):
    """Where checkpoints go (Megatron layout) and what to load at start."""

    dir: str | None = None
    """Checkpoint directory; null: <run_dir>/checkpoints."""
    keep: int | None = 2
    """Newest complete checkpoints kept; 0 or null keeps all."""
    load: str | int | None = "latest"
    """What to load at start: latest or null (resume from the newest complete checkpoint if there is one),
    none (start fresh), an iteration number, or model-only (weights from load_dir; fresh optimizer,
    schedule and iteration count; the one way to start from weights trained with another tokenizer: a
    resume with another is refused). Once dir holds a checkpoint and load_dir is another folder, every
    restart resumes from dir (so a requeued fine-tuning run does not start over)."""
    load_dir: str | None = None
    """Where load looks when it is not dir: another run's checkpoints, one written by
    trainer.convert.from_hf, or Megatron-LM's own (legacy or Megatron-core names, torch or torch_dist
    format; Megatron-LM's torch_dist only with load=model-only); null: dir."""
    format: str = "legacy"
    """How checkpoints are written: legacy (Megatron's torch format, language_model.encoder.* names, read
    by Megatron-LM --use-legacy-models and transformers' converter), mcore (the torch format with
    Megatron-core's decoder.layers.* names: Megatron-LM --ckpt-format torch) or torch_dist (Megatron-core's
    distributed format, Megatron-LM's default since core 0.7: loads at any tp/pp in Megatron-LM, with
    --no-load-optim as the optimizer state is Slipway's). Every format resumes, torch_dist at any layout."""
    async_save: bool = True
    """true: training blocks only while each rank copies its state to host memory (pinned on a GPU); a
    background thread writes the files and commits the checkpoint once every rank's files are durable
    (same files, same bytes, same commit point as a synchronous save). Costs one copy of each rank's
    checkpoint state in host memory for the run (host memory is usually many times a GPU's share); the
    save before a stop and the last one are waited for before the job exits. false: every save blocks
    training until it is committed. On by default: a save's stall is what limits how often a run can
    afford to save (docs/operations.md, "Goodput")."""

    def _normalise(self) -> None:
        if self.load is None:  # "resume when there is something to resume"
            self.load = "latest"
        if isinstance(self.load, str) and self.load.isdigit():
            self.load = int(self.load)

    def problems(self) -> list[ConfigIssue]:
        out = []
        if not isinstance(self.load, int) and self.load not in ("latest", "none", "model-only"):
            out.append(issue("choice", "checkpoint.load", self.load, "must be latest, none, model-only or "
                             "an iteration number", "checkpoint.load=latest"))
        if self.keep is not None and self.keep < 0:
            out.append(issue("positive", "checkpoint.keep", self.keep, "must be 0 or more",
                             "set checkpoint.keep to a count, or 0 to keep all"))
        return out + choice("checkpoint.format", self.format, CHECKPOINT_FORMATS)


@dataclass
class WandbConfig(Section):
    """Weights & Biases (only global rank 0 logs; a requeued job continues the same W&B run)."""

    mode: str = "disabled"
    """online, offline (files under <run_dir>/wandb; upload later with wandb sync) or disabled. The API
    key comes from WANDB_API_KEY (or ~/.netrc) in the job's environment only, never from the config."""
    project: str = "slipway"
    """W&B project."""
    entity: str | None = None
    """W&B team or user; null: the key's default entity."""
    group: str | None = None
    """W&B group; null: the sweep id in a multirun."""
    name: str | None = None
    """W&B run name; null: the run id plus the sweep point's overrides."""
    tags: list[str] = field(default_factory=list)
    """W&B tags."""
    require_online: bool = False
    """online mode only: fail the job (exit 78, not retried) when W&B cannot be reached from rank 0. false:
    a short bounded probe at start-up; when W&B is unreachable (most HPC compute nodes are offline) the run
    logs offline instead, with one warning and the `wandb sync` command in the summary and status."""

    def _normalise(self) -> None:
        self.tags = [str(t) for t in (self.tags or [])]

    def problems(self) -> list[ConfigIssue]:
        return choice("logging.wandb.mode", self.mode, WANDB_MODES)


@dataclass
class LoggingConfig(Section):
    """Experiment tracking and MFU."""

    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases settings."""
    peak_tflops: float | None = None
    """Peak dense TFLOP/s of one device for MFU; null: detected from the GPU name (no MFU on CPU). Set it
    only to override the detection (cluster.device_peak_tflops is the plan's, not the trainer's)."""

    def _normalise(self) -> None:
        if isinstance(self.wandb, dict):
            self.wandb = _build(WandbConfig, self.wandb, "logging.wandb")

    def problems(self) -> list[ConfigIssue]:
        return self.wandb.problems() + positive("logging.peak_tflops", self.peak_tflops, allow_none=True)


@dataclass
class RunConfig(Section):
    """Everything one training run needs. Built with ``from_dict``/``from_yaml``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """GPT shape."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training text and preprocessing."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """Tokenizer files."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor/pipeline layout."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and LR schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Batch, length, precision, cadence."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint location and loading."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Experiment tracking."""
    kernels: str = "auto"
    """Kernel implementation: auto (per op: apex on CUDA when importable, else Slipway's compiled csrc ops,
    else eager), csrc, apex, eager (reference PyTorch compositions), compile (torch.compile of each of
    those alone) or compile_layer (each transformer layer compiled whole by torch.compile from the
    reference ops, so Inductor fuses across them; the embedding, final norm, loss and AdamW stay csrc;
    the first step pays the compilation; not with train.recompute_granularity=selective)."""
    run_dir: str | None = None
    """This run's directory; null: <runs_root>/<experiment>/<run_id> under launch.py, runs/local for the
    standalone trainer."""
    run_id: str | None = None
    """Run id (names the W&B run); null: minted at submit time (date-time-random)."""

    def _normalise(self) -> None:
        # The launcher resolves run_dir itself (orchestrator/base/schema.py overrides this); the standalone
        # trainer needs a concrete folder for its checkpoints, heartbeats and metrics.
        if self.run_dir is None:
            self.run_dir = "runs/local"
        if self.checkpoint.dir is None:
            self.checkpoint.dir = str(RunDir(self.run_dir).checkpoints)

    def problems(self) -> list[ConfigIssue]:
        """Every broken rule of every section (each section also raises its own when built)."""
        out = [i for name in _SECTIONS for i in getattr(self, name).problems()]
        out += self.parallel.layer_issues(self.model.num_layers)  # needs two sections
        out += recipe_issues(self.train, self.optim)
        if self.kernels == "compile_layer" and self.train.recompute_granularity == "selective":
            out.append(issue("compile_layer", "train.recompute_granularity", "selective",
                             "kernels=compile_layer compiles the whole layer, attention included (its "
                             "partitioner chooses what to recompute)",
                             "set train.recompute_granularity to none or full, or choose other kernels"))
        return out + choice("kernels", self.kernels, KERNEL_SETS)

    @classmethod
    def from_dict(cls, d: dict) -> RunConfig:
        """Build from a plain nested dict (e.g. a resolved YAML). Keys the trainer has no use for (the
        orchestrator's sections in a run's ``config.yaml``) are ignored with a warning; a key that looks
        like a typo of a trainer key is an error."""
        return _build(cls, d, "the top level")

    @classmethod
    def from_yaml(cls, path: str) -> RunConfig:
        """Read a resolved YAML (or JSON) config file."""
        import yaml

        with open(path, encoding="utf-8") as f:
            d = yaml.safe_load(f) or {}
        if not isinstance(d, dict):
            raise ValueError(f"{path}: expected a mapping of sections at the top level, "
                             f"got {type(d).__name__}")
        return cls.from_dict(d)

    def to_dict(self) -> dict:
        """Plain nested dict (JSON/YAML-safe); ``from_dict(to_dict())`` round-trips."""
        return dataclasses.asdict(self)


def recipe_issues(train: TrainConfig, optim: OptimConfig) -> list[ConfigIssue]:
    """train.precision_recipe against the optimizer section (the recipe's rules that need both)."""
    t, o = train, optim
    if t.precision == "fp32" or t.precision_recipe not in PRECISION_RECIPES:
        return []
    if o.distributed and t.precision_recipe == "autocast":
        return [issue("recipe", "train.precision_recipe", t.precision_recipe, "the distributed "
                      "optimizer (optim.distributed=true) keeps 16-bit parameters with fp32 masters "
                      "(Megatron's layout)",
                      "set train.precision_recipe=master_weights (or auto), or optim.distributed=false")]
    if precision_recipe(t.precision, t.precision_recipe, o.distributed) == "master_weights" \
            and not o.distributed and o.impl in ("apex", "torch_fused"):
        return [issue("recipe_impl", "optim.impl", o.impl, "steps whole parameters and cannot step the fp32 "
                      "master weights of train.precision_recipe=master_weights (the distributed optimizer's "
                      "flat buffers)", "set optim.impl to auto, csrc, foreach or for_loop, or "
                      "train.precision_recipe=autocast")]
    return []


def _unknown(key: str, known: list[str], where: str) -> None:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    if close:
        raise ValueError(f"unknown key {key!r} in {where}; did you mean {close[0]!r}? Valid keys: {known}")
    log.warning("ignoring key %r in %s (not a trainer setting)", key, where)


def _build(kind: type, values: Any, where: str) -> Any:
    """``kind`` from a mapping, building nested sections by their field types."""
    if isinstance(values, kind):
        return values
    if not isinstance(values, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(values).__name__} ({values!r})")
    fields = {f.name: f for f in dataclasses.fields(kind)}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            _unknown(key, list(fields), where if where == "the top level" else f"section {where!r}")
            continue
        sub = _SECTIONS.get(fields[key].name) if kind is RunConfig else None
        kwargs[key] = _build(sub, value or {}, key) if sub else _coerce(kind, key, value)
    return kind(**kwargs)


def _coerce(kind: type, key: str, value: Any) -> Any:
    """A string where the field is a float, read as YAML 1.2 (Hydra/OmegaConf) would: PyYAML follows
    YAML 1.1, whose float needs a dot, so ``lr: 3e-4`` in a hand-written config arrives as "3e-4"."""
    if not isinstance(value, str):
        return value
    hint = typing.get_type_hints(kind).get(key)
    if hint is float or float in typing.get_args(hint):
        try:
            return float(value)
        except ValueError:
            return value  # the section's own check names the key and the bad value
    return value


_SECTIONS = {"model": ModelConfig, "data": DataConfig, "tokenizer": TokenizerConfig,
             "parallel": ParallelConfig, "optim": OptimConfig, "train": TrainConfig,
             "checkpoint": CheckpointConfig, "logging": LoggingConfig}
