"""The trainer's typed configuration: one small dataclass per component, and ``RunConfig`` tying them.

Section and field names are the shared contract with the Hydra schema (``orchestrator/``) and with users'
YAML files (``model.hidden_size``, ``optim.lr``, ``train.global_batch_size`` ...). The trainer never sees
Hydra: the orchestrator writes a resolved YAML that ``RunConfig.from_yaml`` reads, ignoring the
orchestrator-only top-level sections (cluster, container, dry_run, wait, ...).

Each class validates its own invariants in ``__post_init__``; checks that need the world size (heads % tp,
batch divisibility) live in ``trainer.main`` where the world is known. Functions receive the slice they
need, never the root.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from typing import Any

from trainer import testing_hooks
from trainer.health import HealthConfig
from trainer.log import get_logger
from trainer.parallel.config import ParallelConfig  # the parallel layer's own section, re-exported

log = get_logger(__name__)

PRECISIONS = ("fp32", "bf16", "fp16")
DECAY_STYLES = ("cosine", "linear", "constant", "inverse-square-root")
OPTIM_IMPLS = ("auto", "apex", "csrc", "torch_fused", "foreach", "for_loop")
WANDB_MODES = ("online", "offline", "disabled")
# Top-level keys of a resolved orchestrator config that the trainer has no use for.
ORCHESTRATOR_ONLY = ("cluster", "container", "dry_run", "wait", "hydra", "experiment", "sweep", "stages",
                     "preprocess", "convert", "corpus", "name", "defaults", "runs_root", "cache_dir",
                     *testing_hooks.CONFIG_HOOKS, testing_hooks.SWITCH)
# Keys inside trainer sections that only the orchestrator uses (planning, preprocessing): ignored quietly.
ORCHESTRATOR_KEYS = {"data": ("append_eod", "workers", "corpus", "on_error")}


def _fail(where: str, what: str, fix: str) -> None:
    raise ValueError(f"{where}: {what}. {fix}")


def _positive(where: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        _fail(where, f"must be a positive integer, got {value!r}", "Set it to an integer >= 1.")


def _choice(where: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        _fail(where, f"is {value!r}", f"Use one of {list(choices)}.")


@dataclass
class DataConfig:
    """Tokenized training data (Megatron ``.bin/.idx``)."""

    # Dataset prefixes: either the full prefix ("corpus_content_document") or the preprocess output
    # prefix ("corpus"), to which "_{json_key}_document" is appended. Several prefixes are concatenated.
    paths: list[str] = field(default_factory=list)
    json_key: str = "content"
    # Megatron split string: relative weights of train, valid, test documents.
    split: str = "969,30,1"
    # Where the sample/shuffle index caches go; None: next to the data (Megatron's default).
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.paths, str):
            self.paths = [self.paths]
        self.paths = [str(p) for p in self.paths]
        parts = [p.strip() for p in str(self.split).split(",")]
        try:
            weights = [float(p) for p in parts]
        except ValueError:
            weights = []
        if not weights or len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
            _fail("data.split", f"is {self.split!r}", "Use up to three non-negative weights like '969,30,1'.")


@dataclass
class TokenizerConfig:
    """GPT-2 byte-level BPE files; the vocabulary size and end-of-document id come from ``vocab_file``."""

    vocab_file: str | None = None
    merge_file: str | None = None
    type: str = "GPT2BPETokenizer"
    # Used only without a vocab_file (pre-tokenized data without tokenizer files); model.vocab_size wins.
    vocab_size: int | None = None


@dataclass
class ModelConfig:
    """GPT shape (Megatron names). Converted to the model's own ``GPTConfig`` by ``trainer.main``."""

    num_layers: int = 12
    hidden_size: int = 768
    num_attention_heads: int = 12
    seq_length: int = 1024
    max_position_embeddings: int | None = None  # None: seq_length
    vocab_size: int | None = None  # None: read from tokenizer.vocab_file
    ffn_hidden_size: int | None = None  # None: 4 * hidden_size
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    # Megatron pads the vocabulary to a multiple of this times tp_size.
    make_vocab_size_divisible_by: int = 128
    # "sdpa" (flash/efficient attention on GPU) or "softmax" (explicit scaled causal softmax kernel).
    attention_backend: str = "sdpa"

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                     "make_vocab_size_divisible_by"):
            _positive(f"model.{name}", getattr(self, name))
        _positive("model.vocab_size", self.vocab_size, allow_none=True)
        _positive("model.ffn_hidden_size", self.ffn_hidden_size, allow_none=True)
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        _positive("model.max_position_embeddings", self.max_position_embeddings)
        if self.hidden_size % self.num_attention_heads:
            _fail("model.hidden_size", f"{self.hidden_size} is not divisible by num_attention_heads="
                  f"{self.num_attention_heads}", "Choose sizes with hidden_size % num_attention_heads == 0.")
        if self.seq_length > self.max_position_embeddings:
            _fail("model.seq_length", f"{self.seq_length} exceeds max_position_embeddings="
                  f"{self.max_position_embeddings}", "Raise max_position_embeddings or shorten seq_length.")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                _fail(f"model.{name}", f"is {getattr(self, name)}", "Use a probability in [0, 1).")
        _choice("model.attention_backend", self.attention_backend, ("sdpa", "softmax"))


@dataclass
class OptimConfig:
    """AdamW (Megatron defaults) and the LR schedule, which counts in samples."""

    lr: float = 3e-4
    min_lr: float = 0.0
    warmup_iters: int = 0
    decay_iters: int | None = None  # None: train.iters
    decay_style: str = "cosine"
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # 0 disables clipping (the norm is still computed and logged)
    # Implementation: auto = apex FusedAdam on CUDA if importable, else torch fused on CUDA, else foreach.
    impl: str = "auto"

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            _fail("optim.lr/min_lr", f"lr={self.lr}, min_lr={self.min_lr}", "Need 0 <= min_lr <= lr, lr > 0.")
        if self.warmup_iters < 0:
            _fail("optim.warmup_iters", f"is {self.warmup_iters}", "Use 0 or more.")
        if self.decay_iters is not None and self.decay_iters < self.warmup_iters:
            _fail("optim.decay_iters", f"{self.decay_iters} < warmup_iters={self.warmup_iters}",
                  "Decay must end after warm-up.")
        _choice("optim.decay_style", self.decay_style, DECAY_STYLES)
        _choice("optim.impl", self.impl, OPTIM_IMPLS)
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            _fail("optim.adam_beta1/2", f"are {self.adam_beta1}, {self.adam_beta2}", "Use values in [0, 1).")
        if self.weight_decay < 0 or self.clip_grad < 0 or self.adam_eps <= 0:
            _fail("optim", f"weight_decay={self.weight_decay}, clip_grad={self.clip_grad}, adam_eps="
                  f"{self.adam_eps}", "weight_decay and clip_grad must be >= 0, adam_eps > 0.")


@dataclass
class TrainConfig:
    """Batch sizes, length, precision, and the save/eval/log cadence (all in iterations)."""

    micro_batch_size: int = 1
    global_batch_size: int | None = None  # None: micro_batch_size * data-parallel size
    iters: int = 1000
    precision: str = "fp32"
    seed: int = 1234
    save_interval: int | None = None  # None: save only on stop and at the end
    eval_interval: int | None = 1000  # None: no evaluation
    eval_iters: int = 10
    log_interval: int = 10
    # Deterministic algorithms (bitwise-reproducible resume on CPU; slower on GPU).
    deterministic: bool = False
    device: str = "auto"  # auto | cpu | cuda
    # fp16 dynamic loss scaling (Megatron defaults).
    initial_loss_scale: float = 2.0**32
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    # Heartbeats, hang watchdog and start-up preflight (trainer.health, trainer.preflight).
    heartbeat_interval_s: float = 10.0  # seconds between each rank's heartbeat file writes
    hang_timeout_s: float | None = 1800.0  # no training progress this long ends the job; 0/None: off
    preflight: bool = True  # all-reduce + node-pair bandwidth check at start (multi-rank only)
    preflight_timeout_s: float = 60.0  # a rank or node not answering within this fails the start
    preflight_mb: float = 4.0  # payload of each timed preflight exchange
    preflight_slow_factor: float = 4.0  # a node this many times slower than the median node fails it

    def __post_init__(self) -> None:
        _positive("train.micro_batch_size", self.micro_batch_size)
        _positive("train.global_batch_size", self.global_batch_size, allow_none=True)
        _positive("train.iters", self.iters)
        _positive("train.save_interval", self.save_interval, allow_none=True)
        _positive("train.eval_interval", self.eval_interval, allow_none=True)
        _positive("train.log_interval", self.log_interval)
        _positive("train.loss_scale_window", self.loss_scale_window)
        _positive("train.hysteresis", self.hysteresis)
        if self.eval_iters < 0:
            _fail("train.eval_iters", f"is {self.eval_iters}", "Use 0 or more.")
        _choice("train.precision", self.precision, PRECISIONS)
        _choice("train.device", self.device, ("auto", "cpu", "cuda"))
        if self.global_batch_size is not None and self.global_batch_size % self.micro_batch_size:
            _fail("train.global_batch_size", f"{self.global_batch_size} is not a multiple of "
                  f"micro_batch_size={self.micro_batch_size}", "Make it micro_batch_size x dp x n.")
        if not 0 < self.min_loss_scale <= self.initial_loss_scale:
            _fail("train.min_loss_scale", f"{self.min_loss_scale} vs initial {self.initial_loss_scale}",
                  "Need 0 < min_loss_scale <= initial_loss_scale.")
        self.health()  # validates the health fields

    def health(self) -> HealthConfig:
        """The heartbeat/watchdog/preflight slice."""
        return HealthConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(HealthConfig)})


@dataclass
class CheckpointConfig:
    """Where checkpoints go and what to load at start.

    ``load``: "latest" (resume from the newest complete checkpoint if any, else start fresh), "none"
    (start fresh), an iteration number (full state at that iteration), or "model-only" (weights only,
    fresh optimizer/schedule/iteration: a fine-tuning start). ``load_dir`` (default ``dir``) is where
    ``load`` looks. Once ``dir`` holds a checkpoint of its own and differs from ``load_dir``, a restart
    always resumes from ``dir`` (so a requeued fine-tuning run does not start over).
    """

    dir: str | None = None  # None: {run_dir}/checkpoints
    keep: int | None = 3  # newest K complete checkpoints kept; None or 0 keeps all
    load: str | int = "latest"
    load_dir: str | None = None

    def __post_init__(self) -> None:
        if self.load is None:  # the orchestrator's "resume when there is something to resume"
            self.load = "latest"
        if isinstance(self.load, str) and self.load.isdigit():
            self.load = int(self.load)
        if not isinstance(self.load, int) and self.load not in ("latest", "none", "model-only"):
            _fail("checkpoint.load", f"is {self.load!r}", "Use latest, none, model-only or an iteration.")
        if self.keep is not None and self.keep < 0:
            _fail("checkpoint.keep", f"is {self.keep}", "Use a positive number, or 0/None to keep all.")


@dataclass
class WandbConfig:
    """Weights & Biases. The API key comes from the environment (WANDB_API_KEY) or netrc, never config."""

    mode: str = "disabled"
    project: str = "slipway"
    entity: str | None = None
    group: str | None = None
    name: str | None = None
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        _choice("logging.wandb.mode", self.mode, WANDB_MODES)
        self.tags = [str(t) for t in (self.tags or [])]


@dataclass
class LoggingConfig:
    """Log lines, MFU and W&B."""

    wandb: WandbConfig = field(default_factory=WandbConfig)
    # Peak dense TFLOP/s per device for MFU; None: detected from the GPU name (no MFU on CPU).
    peak_tflops: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.wandb, dict):
            self.wandb = _build(WandbConfig, self.wandb, "logging.wandb")


@dataclass
class RunConfig:
    """Everything one training run needs. Built with ``from_dict``/``from_yaml``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    kernels: str = "auto"
    run_dir: str = "runs/local"
    run_id: str | None = None  # minted by the orchestrator; names the W&B run

    def __post_init__(self) -> None:
        if self.run_dir is None:
            self.run_dir = "runs/local"
        if self.checkpoint.dir is None:
            self.checkpoint.dir = os.path.join(self.run_dir, "checkpoints")

    @classmethod
    def from_dict(cls, d: dict) -> RunConfig:
        """Build from a plain nested dict (e.g. a resolved YAML); orchestrator-only sections are ignored."""
        sections = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in d.items():
            if key in sections:
                kind = _SECTION_TYPES.get(key)
                kwargs[key] = _build(kind, value or {}, key) if kind else value
            elif key in ORCHESTRATOR_ONLY:
                continue
            else:
                _unknown(key, list(sections) + list(ORCHESTRATOR_ONLY), "the top level")
        return cls(**kwargs)

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


_SECTION_TYPES = {"model": ModelConfig, "data": DataConfig, "tokenizer": TokenizerConfig,
                  "parallel": ParallelConfig, "optim": OptimConfig, "train": TrainConfig,
                  "checkpoint": CheckpointConfig, "logging": LoggingConfig}


def _unknown(key: str, known: list[str], where: str) -> None:
    """A key that looks like a typo of a known one is an error; anything else is ignored with a warning
    (the orchestrator's schema may carry keys only it uses, e.g. preprocessing options under data)."""
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    if close:
        raise ValueError(f"unknown key {key!r} in {where}; did you mean {close[0]!r}? Valid keys: {known}")
    log.warning("ignoring key %r in %s (not a trainer setting)", key, where)


def _build(kind: type, values: Any, where: str) -> Any:
    if isinstance(values, kind):
        return values
    if not isinstance(values, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(values).__name__} ({values!r})")
    names = [f.name for f in dataclasses.fields(kind)]
    kwargs = {}
    for key, value in values.items():
        if key in names:
            kwargs[key] = value
        elif key not in ORCHESTRATOR_KEYS.get(where, ()):
            _unknown(key, names, f"section {where!r}")
    return kind(**kwargs)
