"""Typed configuration schema, registered with Hydra's ConfigStore.

Every group YAML in ``hydra_conf/`` merges into one of these dataclasses, so a typo'd key or a value of the
wrong type fails at composition with Hydra's own message (``Key 'lrr' not in 'OptimConfig'``). The
dataclasses hold values only; cross-field rules that need several sections (heads % tp, world size, memory)
live in :mod:`orchestrator.plan`, which reports every problem at once with the key, the value and the fix.

Each field's documentation is the string literal right below it (an attribute docstring):
``python -m orchestrator.docs`` turns them into ``docs/config.md``, and a test fails when that file is not
current. Field names are a user contract (see the brief): keep them stable.
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
    """GPT shape (Megatron's names). ``vocab_size`` is not here: it comes from the tokenizer."""

    num_layers: int = 2
    """Transformer blocks; parallel.pp_size must divide it."""
    hidden_size: int = 64
    """Width of the residual stream; a multiple of num_attention_heads."""
    num_attention_heads: int = 4
    """Attention heads per layer; parallel.tp_size must divide it."""
    seq_length: int = 64
    """Tokens per training sequence."""
    max_position_embeddings: int = 64
    """Rows of the learned position embedding; at least seq_length."""
    hidden_dropout: float = 0.1
    """Dropout probability on the residual branches (attention and MLP outputs)."""
    attention_dropout: float = 0.1
    """Dropout probability on the attention weights."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation (output projections are scaled by
    1/sqrt(2·num_layers), as in Megatron)."""


@dataclass
class ParallelConfig:
    """Tensor/pipeline layout; data parallelism is whatever the world size leaves (world / (tp·pp))."""

    tp_size: int = 1
    """Tensor-parallel ranks per layer (keep them inside one node: they all-reduce in every layer)."""
    pp_size: int = 1
    """Pipeline stages (model.num_layers must divide evenly)."""
    sequence_parallel: bool = False
    """Shard the LayerNorm/dropout regions along the sequence across the tensor-parallel group (saves
    activation memory, same math; needs tp_size > 1)."""
    schedule: str = "1f1b"
    """Pipeline schedule: 1f1b (one forward, one backward; less activation memory) or afab (all forward,
    then all backward)."""


@dataclass
class TrainConfig:
    """Batch sizes, length, precision, and the save/eval/log cadence (all counted in iterations)."""

    micro_batch_size: int = 4
    """Sequences per forward/backward pass on one data-parallel rank."""
    global_batch_size: int = 8
    """Sequences per optimizer step over all ranks; a multiple of micro_batch_size × dp (the rest is
    gradient accumulation, or the pipeline's micro-batches)."""
    iters: int = 100
    """Optimizer steps in the whole run (requeues and retries included)."""
    precision: str = "fp32"
    """fp32, bf16 (autocast; fp32 weights and optimizer) or fp16 (autocast with dynamic loss scaling;
    needs GPUs)."""
    seed: int = 1234
    """Seed of the initialisation, the data order and dropout; the same seed gives the same model under
    every (tp, pp) layout."""
    save_interval: int = 50
    """Iterations between checkpoints (one is also saved on a stop signal and at the end)."""
    eval_interval: int = 50
    """Iterations between validation passes."""
    eval_iters: int = 2
    """Validation batches per validation pass."""
    log_interval: int = 10
    """Iterations between log lines (loss, learning rate, tokens/s, TFLOP/s, MFU) and W&B points."""
    deterministic: bool = False
    """Deterministic algorithms: bitwise-reproducible steps and resumes (used by the resume tests;
    slower on GPU)."""
    heartbeat_interval_s: float = 10.0
    """Seconds between heartbeat files (iteration, time, host, pid) that every rank writes to
    <run_dir>/heartbeats/; `python -m orchestrator status` marks ranks whose heartbeat is old as stale."""
    hang_timeout_s: float | None = 1800.0
    """Seconds without training progress (a step, evaluation batch or save) after which every waiting rank
    ends itself with exit code 70, so the retry policy resumes from the last checkpoint instead of a hung
    collective holding the allocation. One step, evaluation batch or checkpoint save must fit in it;
    start-up is not counted. 0 or null: off."""
    preflight: bool = True
    """At job start (multi-rank only): check in every rank, time data exchanges between every node pair
    and an all-reduce across all ranks; the figures go to <run_dir>/preflight.json."""
    preflight_timeout_s: float = 60.0
    """A rank or node pair not answering the preflight within this fails the job naming the node."""
    preflight_mb: float = 4.0
    """Megabytes moved in each timed preflight exchange."""
    preflight_slow_factor: float = 4.0
    """A node whose best link is this many times slower than the median node's fails the preflight
    (judged with three or more nodes)."""


@dataclass
class OptimConfig:
    """AdamW (Megatron's defaults) and the learning-rate schedule."""

    lr: float = 5.0e-4
    """Peak learning rate, reached at the end of the warm-up."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay (kept after it); at most lr."""
    warmup_iters: int = 0
    """Iterations of linear warm-up from 0 to lr."""
    decay_iters: int | None = None
    """Iterations from the start to the end of the decay; null: train.iters."""
    decay_style: str = "cosine"
    """Decay from lr to min_lr: cosine, linear, constant or inverse-square-root."""
    weight_decay: float = 0.1
    """Decoupled (AdamW) weight decay; not applied to biases and LayerNorm weights."""
    adam_beta1: float = 0.9
    """Adam's first-moment decay."""
    adam_beta2: float = 0.999
    """Adam's second-moment decay."""
    adam_eps: float = 1.0e-8
    """Adam's epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""


@dataclass
class CorpusConfig:
    """Optional corpus stage: build a JSONL corpus on the cluster instead of reading ``data.paths``."""

    source: str = "stdlib"
    """stdlib: the standard library of the interpreter that runs the job (when roots is empty)."""
    roots: list[str] = field(default_factory=list)
    """Folders searched for *.py files instead of the standard library."""
    max_files: int | None = None
    """Stop after this many files; null: every file."""
    max_bytes: int | None = None
    """Stop before the text exceeds this many bytes; null: no limit."""
    exclude_tests: bool = False
    """Skip folders named test, tests, idle_test and unittests."""


@dataclass
class DataConfig:
    """Training text and its preprocessing into Megatron ``.bin/.idx`` (cached by content)."""

    paths: list[str] = field(default_factory=list)
    """JSONL files (one document per line, .gz allowed) to preprocess; ignored when corpus is set."""
    json_key: str = "content"
    """The JSON field that holds each document's text."""
    split: str = "969,30,1"
    """Relative weights of the train, validation and test documents (Megatron's split string)."""
    append_eod: bool = True
    """Append <|endoftext|> to every document."""
    workers: int = 2
    """Tokenizer worker processes of the preprocessing job."""
    on_error: str = "fail"
    """Bad JSONL lines (invalid JSON or UTF-8, missing or non-string key): fail stops the preprocessing
    job at the first one, naming file:line (training never starts); skip drops them, counts them by reason
    and copies the report (file:line of each) to <run_dir>/data_report.json."""
    corpus: CorpusConfig | None = None
    """Build the corpus on the cluster (see data.corpus); null: read paths."""


@dataclass
class TokenizerConfig:
    """Existing GPT-2 BPE files, or (both null) a tokenizer trained on the corpus by the corpus stage."""

    vocab_file: str | None = None
    """GPT-2 BPE vocab.json; null (with merge_file null): train one in the corpus stage."""
    merge_file: str | None = None
    """GPT-2 BPE merges.txt that goes with vocab_file."""
    vocab_size: int | None = None
    """Without files: the size of the vocabulary to train. With files: used only by the plan's memory
    table while vocab_file is not readable from the login node (the file wins when it is)."""


@dataclass
class CheckpointConfig:
    """Where checkpoints go (Megatron layout) and what to load at start."""

    dir: str | None = None
    """Checkpoint directory; null: <run_dir>/checkpoints."""
    keep: int = 2
    """Newest complete checkpoints kept; 0 keeps all."""
    load: str | None = None
    """What to load at start: null or latest (resume from the newest checkpoint if there is one), none
    (start fresh), an iteration number, or model-only (weights from load_dir; fresh optimizer, schedule
    and iteration count). Once dir holds a checkpoint and load_dir is another folder, every restart
    resumes from dir."""
    load_dir: str | None = None
    """Where load looks when it is not dir: another run's checkpoints, or one written by
    trainer.convert.from_hf; null: dir."""


@dataclass
class WandbConfig:
    """Weights & Biases (only global rank 0 logs; a requeued job continues the same W&B run)."""

    mode: str = "offline"
    """online, offline (files under <run_dir>/wandb; upload later with wandb sync) or disabled. The API
    key comes from WANDB_API_KEY (or ~/.netrc) in the job's environment only."""
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


@dataclass
class LoggingConfig:
    """Experiment tracking."""

    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases settings."""


@dataclass
class ClusterConfig:
    """Where jobs run, what they ask the scheduler for, and what one device can do (for the plan)."""

    name: str | None = None
    """Label in plans and scripts; null: the Hydra choice (cluster=devcluster → devcluster)."""
    executor: str = "local"
    """local (submitit's LocalExecutor: processes on this machine) or slurm."""
    partition: str | None = None
    """Slurm partition of the training job; null: the site default."""
    account: str | None = None
    """Slurm account (sbatch --account); null: none given."""
    qos: str | None = None
    """Slurm QOS (sbatch --qos); null: none given."""
    nodes: int = 1
    """Nodes of the training job."""
    gpus_per_node: int = 0
    """GPUs per node; 0: a CPU-only cluster (gloo), where training runs tasks_per_node tasks per node."""
    tasks_per_node: int | None = None
    """Training ranks per node; null: gpus_per_node (one task per GPU), or tp_size × pp_size on the local
    executor without GPUs."""
    cpus_per_task: int = 1
    """CPU cores per training task (sbatch --cpus-per-task)."""
    mem_gb: float | None = None
    """Memory per node (sbatch --mem); 0: all of the node's memory; null: the site default."""
    time_limit_min: int = 60
    """Wall-clock limit of one training job allocation, in minutes; longer runs requeue."""
    exclusive: bool = False
    """Ask for whole nodes (sbatch --exclusive)."""
    constraint: str | None = None
    """Node features (sbatch --constraint), e.g. a GPU type."""
    sbatch_extra: dict[str, str] = field(default_factory=dict)
    """More #SBATCH --key=value lines, as a mapping."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables exported in every job (NCCL_*, OMP_NUM_THREADS, ...); never secrets (refused)."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run before srun in every job (module load ..., source ...)."""
    max_retries: int = 1
    """Crashed training attempts retried in the same allocation, each from the last checkpoint."""
    max_timeouts: int = 10
    """Requeues after reaching the time limit (preemptions are requeued without limit)."""
    signal_delay_s: int = 120
    """Seconds before the time limit at which Slurm sends USR2 (--signal=USR2@lead): the time the trainer
    has to save a checkpoint."""
    backend: str | None = None
    """torch.distributed backend; null: nccl with GPUs, gloo without."""
    stage_cpus: int = 2
    """CPU cores of the corpus, preprocess and convert jobs (single-task CPU jobs)."""
    stage_time_limit_min: int = 60
    """Time limit of those jobs, in minutes."""
    stage_partition: str | None = None
    """Partition of those jobs; null: the training partition."""
    device_name: str = "cpu"
    """Planning: the device's name in the plan (a GPU model, or cpu)."""
    device_memory_gb: float = 0.0
    """Planning: memory of one device in GB; 0: unknown, the memory check is skipped."""
    device_peak_tflops: float = 0.05
    """Planning and MFU: dense peak TFLOP/s of one device in the training precision (A100 312, H100 989)."""
    device_bf16: bool = True
    """Planning: the device supports bf16 (false refuses train.precision=bf16)."""
    mfu: float = 0.4
    """Planning: assumed model FLOPs utilisation for the ETA."""
    reserved_memory_gb: float = 2.0
    """Planning: memory per device taken by the CUDA context, allocator fragmentation and communication
    buffers."""


@dataclass
class ContainerConfig:
    """The image jobs run in (see containers/README.md)."""

    kind: str = "none"
    """none (the submitting Python environment) or apptainer."""
    image: str | None = None
    """Path of the .sif image on shared storage (containers/build.sh builds one)."""
    apptainer_bin: str = "apptainer"
    """The apptainer executable (a name on PATH or a path)."""
    binds: list[str] = field(default_factory=list)
    """Extra host paths to bind; the code, runs_root, the cache and the data folders are bound already."""
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
    """Variables forwarded into the --cleanenv container via APPTAINERENV_ (shell glob patterns)."""
    env_denylist: list[str] = field(default_factory=lambda: ["*_TOKEN_PATH", "*_KEY_FILE", "WANDB_DIR"])
    """Never forwarded: variables naming files that hold secrets on the host (not bound in the image)."""


@dataclass
class ConvertConfig:
    """The post-training conversion to a Hugging Face model in <run_dir>/hf."""

    enabled: bool = True
    """Run the convert stage after training (afterok)."""
    verify: bool = True
    """Check the converted model against the checkpoint: logits within 1e-4, identical greedy generation."""


@dataclass
class SlipwayConfig:
    """The root: one section per component plus the launch switches."""

    experiment: str = "default"
    """Experiment name: the first level of the run directory (<runs_root>/<experiment>/<run_id>)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """GPT shape."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Tensor/pipeline layout."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Batch, length, precision, cadence."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and LR schedule."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training text and preprocessing."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """Tokenizer files."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint location and loading."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Experiment tracking."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Scheduler, resources and planning figures."""
    container: ContainerConfig = field(default_factory=ContainerConfig)
    """Container image."""
    convert: ConvertConfig = field(default_factory=ConvertConfig)
    """Post-training conversion."""
    kernels: str = "auto"
    """Kernel implementation: auto (per op: apex on CUDA when importable, else Slipway's compiled csrc ops,
    else eager), csrc, apex, eager (reference PyTorch compositions) or compile (torch.compile of those)."""
    runs_root: str = "runs"
    """Folder that holds every run directory and the stage cache."""
    cache_dir: str | None = None
    """Content-addressed outputs of the shared stages (corpus, preprocess); null: <runs_root>/_cache."""
    run_dir: str | None = None
    """This run's directory; null: <runs_root>/<experiment>/<run_id>."""
    run_id: str | None = None
    """Run id; null: minted at submit time (date-time-random)."""
    dry_run: bool = False
    """Print the plan (layout, memory, ETA, stages, problems) and the job scripts; submit nothing."""
    wait: bool | None = None
    """Block until the run ends; null: block for the local executor (its jobs are this machine's
    processes), return at once for Slurm and for sweeps."""
    fail_train: str | None = None
    """Test hook: start makes training fail on purpose (exercises afterok and retries). Refused unless
    testing=true."""
    stall_train: int | None = None
    """Test hook: after this iteration (once per run) every rank pauses until a signal arrives (at most
    10 min), so fault tests can preempt, time out or kill a job at a known point. Refused unless
    testing=true."""
    testing: bool = False
    """Allow the test-only hooks (fail_train, stall_train, and the SLIPWAY_* failpoint variables of
    trainer/testing_hooks.py in cluster.env or the launching environment); without it the plan refuses
    each one (test_hook). For Slipway's own fault tests; never set it for a real run."""


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
