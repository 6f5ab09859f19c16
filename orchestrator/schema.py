"""Typed configuration schema, registered with Hydra's ConfigStore.

Every group YAML in ``hydra_conf/`` merges into one of these dataclasses, so a typo'd key or a value of the
wrong type fails at composition with Hydra's own message (``Key 'lrr' not in 'OptimConfig'``). The
dataclasses hold values only; cross-field rules that need several sections (heads % tp, world size, memory)
live in :mod:`orchestrator.plan`, which reports every problem at once with the key, the value and the fix.

Field names are a user contract (see the brief): keep them stable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

PRECISIONS = ("fp32", "bf16", "fp16")
SCHEDULES = ("1f1b", "afab")
EXECUTORS = ("local", "slurm")
CONTAINER_KINDS = ("none", "apptainer")
WANDB_MODES = ("online", "offline", "disabled")


@dataclass
class ModelConfig:
    """GPT shape. ``vocab_size`` is not here: it comes from the tokenizer (see TokenizerConfig)."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    seq_length: int = 64
    max_position_embeddings: int = 64
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_std: float = 0.02


@dataclass
class ParallelConfig:
    """Tensor/pipeline layout; data parallelism is whatever the world size leaves (world / (tp·pp))."""

    tp_size: int = 1
    pp_size: int = 1
    sequence_parallel: bool = False
    schedule: str = "1f1b"  # "1f1b" | "afab"


@dataclass
class TrainConfig:
    micro_batch_size: int = 4
    global_batch_size: int = 8
    iters: int = 100
    precision: str = "fp32"  # fp32 | bf16 | fp16
    seed: int = 1234
    save_interval: int = 50
    eval_interval: int = 50
    eval_iters: int = 2
    log_interval: int = 10
    deterministic: bool = False  # bitwise-reproducible steps (resume tests; slower on GPU)
    # Planning only (memory table): whether activations are recomputed in the backward pass.
    recompute_activations: bool = False


@dataclass
class OptimConfig:
    lr: float = 5.0e-4
    min_lr: float = 0.0
    warmup_iters: int = 0
    decay_iters: int | None = None  # None: decay over train.iters
    decay_style: str = "cosine"
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1.0e-8
    clip_grad: float = 1.0


@dataclass
class CorpusConfig:
    """Optional corpus stage: build a JSONL corpus on the cluster instead of reading ``data.paths``."""

    source: str = "stdlib"  # "stdlib": the standard library of the interpreter that runs the job
    roots: list[str] = field(default_factory=list)  # folders of *.py files instead of the stdlib
    max_files: int | None = None  # None: every file
    max_bytes: int | None = None  # None: no limit
    exclude_tests: bool = False


@dataclass
class DataConfig:
    paths: list[str] = field(default_factory=list)  # JSONL inputs (ignored when ``corpus`` is set)
    json_key: str = "content"
    split: str = "969,30,1"
    append_eod: bool = True
    workers: int = 2  # preprocessing worker processes
    corpus: CorpusConfig | None = None


@dataclass
class TokenizerConfig:
    """Existing GPT-2 BPE files, or (both None) a tokenizer trained on the corpus by the corpus stage."""

    vocab_file: str | None = None
    merge_file: str | None = None
    # Size of the vocabulary to train when the files are not given; when they are, used only to plan
    # (memory table) while the file is not readable from this machine. None: read it from vocab_file.
    vocab_size: int | None = None


@dataclass
class CheckpointConfig:
    dir: str | None = None  # None: <run_dir>/checkpoints
    keep: int = 2
    load: str | None = None  # None: resume from dir when a checkpoint exists there


@dataclass
class WandbConfig:
    mode: str = "offline"  # online | offline | disabled; the API key comes from WANDB_API_KEY only
    project: str = "slipway"
    entity: str | None = None
    group: str | None = None  # None: the sweep id in a multirun
    name: str | None = None  # None: run id plus the point's overrides
    tags: list[str] = field(default_factory=list)


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class ClusterConfig:
    """Where jobs run and what one device can do (for the plan)."""

    name: str | None = None  # None: the Hydra choice (cluster=devcluster → "devcluster")
    executor: str = "local"  # local (submitit LocalExecutor) | slurm
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    nodes: int = 1
    gpus_per_node: int = 0  # 0: CPU-only cluster (gloo); training then runs tasks_per_node tasks per node
    tasks_per_node: int | None = None  # None: gpus_per_node (one task per GPU)
    cpus_per_task: int = 1
    mem_gb: float | None = None  # sbatch --mem per node; 0: all of the node's memory; None: site default
    time_limit_min: int = 60
    exclusive: bool = False
    constraint: str | None = None
    sbatch_extra: dict[str, str] = field(default_factory=dict)  # more #SBATCH --key=value lines
    env: dict[str, str] = field(default_factory=dict)  # exported in every job (NCCL_*, ...)
    setup: list[str] = field(default_factory=list)  # shell lines before srun (module load ...)
    max_retries: int = 1  # crashed training attempts retried from the last checkpoint
    max_timeouts: int = 10  # requeues after hitting the time limit (preemptions are unlimited)
    signal_delay_s: int = 120  # --signal=USR2@lead: seconds the trainer gets to save before the kill
    backend: str | None = None  # torch.distributed backend; None: nccl with GPUs, gloo without
    # Stage jobs (corpus, preprocess, convert) are CPU jobs.
    stage_cpus: int = 2
    stage_time_limit_min: int = 60
    stage_partition: str | None = None  # None: the training partition
    # Planning figures for one device (GPU, or one CPU task when gpus_per_node is 0).
    device_name: str = "cpu"
    device_memory_gb: float = 0.0  # 0: unknown, the memory check is skipped
    device_peak_tflops: float = 0.05
    device_bf16: bool = True
    mfu: float = 0.4  # assumed model FLOPs utilisation for the ETA
    reserved_memory_gb: float = 2.0  # CUDA context, allocator fragmentation, communication buffers


@dataclass
class ContainerConfig:
    kind: str = "none"  # none | apptainer
    image: str | None = None  # path to the .sif
    apptainer_bin: str = "apptainer"
    binds: list[str] = field(default_factory=list)  # extra host paths; data, runs and code are added
    # Variables forwarded into the --cleanenv container via APPTAINERENV_ (shell glob patterns).
    env_allowlist: list[str] = field(
        default_factory=lambda: [
            "NCCL_*",
            "MASTER_*",
            "SLURM_*",
            "SUBMITIT_*",
            "WANDB_*",
            "HF_*",
            "CUDA_VISIBLE_DEVICES",
            "TORCH_*",
            "SLIPWAY_*",
            "PYTHONUNBUFFERED",
        ]
    )
    # Never forwarded: variables naming files that hold secrets on the host (not bound in the image).
    env_denylist: list[str] = field(default_factory=lambda: ["*_TOKEN_PATH", "*_KEY_FILE", "WANDB_DIR"])


@dataclass
class ConvertConfig:
    enabled: bool = True
    verify: bool = True  # compare logits of the HF model with the source checkpoint


@dataclass
class SlipwayConfig:
    """The root: one section per component plus the launch switches."""

    experiment: str = "default"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    container: ContainerConfig = field(default_factory=ContainerConfig)
    convert: ConvertConfig = field(default_factory=ConvertConfig)
    kernels: str = "auto"
    runs_root: str = "runs"
    cache_dir: str | None = None  # content-addressed stage outputs; None: <runs_root>/_cache
    run_dir: str | None = None  # None: <runs_root>/<experiment>/<run_id>
    run_id: str | None = None  # None: minted at submit time
    dry_run: bool = False
    wait: bool | None = None  # None: block for the local executor (its jobs are this machine's), not Slurm
    # Test hook: make training fail on purpose (exercises afterok / retry). Never set in shipped configs.
    fail_train: str | None = None


def register() -> None:
    """Register the schema; group YAMLs extend it through the primary config's defaults list."""
    cs = ConfigStore.instance()
    cs.store(name="slipway_schema", node=SlipwayConfig)


def to_typed(cfg: Any, choices: dict[str, Any] | None = None) -> SlipwayConfig:
    """OmegaConf DictConfig (composed) → plain, resolved SlipwayConfig dataclass tree.

    ``choices``: Hydra's group choices (``hydra.runtime.choices``), used for names a group file omits.
    """
    from omegaconf import OmegaConf

    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, SlipwayConfig):  # composed without the schema (e.g. a bare dict in a test)
        obj = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SlipwayConfig), cfg))
    if obj.cluster.name is None:
        obj.cluster.name = str((choices or {}).get("cluster") or obj.cluster.executor)
    return obj  # type: ignore[return-value]
