"""Typed configuration schema, registered with Hydra's ConfigStore.

The root :class:`SlipwayConfig` is the trainer's :class:`trainer.config.RunConfig` (the one definition of
every trainer section, key, default and rule) plus the orchestrator's own sections (cluster, container,
convert) and launch switches, defined here. Every group YAML in ``hydra_conf/`` merges into it, so a
typo'd key or a value of the wrong type fails at composition (Hydra's own error, which launch.py says as a
problem with its fix: orchestrator/launch/hydra_errors.py). Each section's own rules are its
``problems()``; :func:`to_typed` builds the tree with them deferred, and the checks
(orchestrator/checks/) report them together with the rules that need several sections (heads % tp, world
size, memory): every problem at once, with the key, the value and the fix.

Each field's documentation is the string literal right below it (an attribute docstring):
``python -m orchestrator.docs`` turns them into ``docs/config.md``, and a test fails when that file is not
current. Field names are a user contract (see the brief): keep them stable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from orchestrator.base.config_keys import unknown_keys
from orchestrator.base.problems import PlanError, Problem
from trainer.config import RunConfig
from trainer.config_issues import ConfigIssue, Section, choice, declared_defaults, deferred, issue, positive
from trainer.eval.config import EvalConfig

EXECUTORS = ("local", "slurm")
CONTAINER_KINDS = ("none", "apptainer", "pyxis", "charliecloud")
LAYOUT_MODES = ("manual", "auto")
TUNE_MODES = ("false", "true", "force")
SWEEP_PLANS = ("first", "all")
RECOMPUTE_CHOICES = ("none", "selective", "full")


@dataclass
class ClusterConfig(Section):
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
    """Nodes of the training job: part of the layout a run asks for (with cluster.gpus set, derived from it;
    at most cluster.max_nodes)."""
    gpus: int | None = None
    """GPUs of the training job in all, on whole nodes of the site's gpus_per_node (nodes = gpus /
    gpus_per_node): how an experiment asks for its size on any site; null: cluster.nodes nodes. A
    cluster.nodes from a later source (the command line over an experiment) replaces it."""
    max_nodes: int | None = None
    """Site hardware: the most nodes one job can have here (the partition's size or limit); null: not
    checked."""
    gpus_per_node: int = 0
    """Site hardware: GPUs per node; the training job takes them all, one task each. 0: a CPU-only cluster
    (gloo), where training runs tasks_per_node tasks per node."""
    cpus_per_node: int | None = None
    """Site hardware: CPU cores per node (tasks_per_node × cpus_per_task and stage_cpus must fit); null:
    not checked."""
    mem_per_node_gb: float | None = None
    """Site hardware: memory per node in GB (mem_gb must fit); null: not checked."""
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
    """Variables exported in every job (NCCL_*, UCX_TLS, OMP_NUM_THREADS, ...) and, by name, into the
    container in every runtime (whatever container.env_allowlist/env_denylist say); never secrets
    (refused)."""
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
    stage_mem_gb: float | None = None
    """Memory of each of the corpus, preprocess, convert and eval jobs in GB (sbatch --mem; 0: all of a
    node's); null: each stage's own figure, in whole GB: corpus 2, preprocess 2 + 0.5 per data.workers,
    convert 2 + 24 bytes per model parameter (the checkpoint with its optimizer state, the converted model
    and the one it is verified against), eval 2 + 8 bytes per parameter + 0.5 per eval.workers (the local
    executor asks for none)."""
    stage_time_limit_min: int = 60
    """Time limit of those jobs, in minutes."""
    stage_partition: str | None = None
    """Partition of those jobs; null: the training partition."""
    device_name: str = "cpu"
    """Site hardware: the GPU model, a name the device table knows (trainer/devices.py: A100-40GB,
    A100-80GB, H100-SXM-80GB (also H100 or H100-80GB), H100-PCIe-80GB, H100-NVL-94GB, H200, GH200, B200,
    L40S), or cpu. Another name needs device_peak_tflops and device_memory_gb."""
    device_memory_gb: float | None = None
    """Site hardware: memory of one device in GB; null: the device table's; 0: unknown (the memory check
    is skipped)."""
    device_peak_tflops: float | None = None
    """Site hardware: dense peak TFLOP/s of one device in the training precision, for the plan's time
    estimate; null: the device table's for train.precision (0.05 for cpu). The trainer's MFU uses the GPU
    it runs on (logging.peak_tflops overrides)."""
    device_bf16: bool | None = None
    """Site hardware: the device supports bf16 (false refuses train.precision=bf16); null: the device
    table's (true for cpu)."""
    bus_bandwidth_gbps: float = 25.0
    """Site hardware: the all-reduce bus bandwidth between the job's GPUs in GB/s, as nccl-tests'
    all_reduce_perf prints it (busbw, large messages, across two nodes): the plan's data-parallel gradient
    exchange takes bytes × 2(dp − 1)/dp / busbw per step. Default 25: about what one 200 Gb/s HDR
    InfiniBand link per node gives; NVLink within a node and a NIC per GPU give 10-20× more."""
    intra_node_bandwidth_gbps: float | None = None
    """Site hardware: the bus bandwidth of a collective among one node's GPUs in GB/s (nccl-tests' busbw
    within a node): the plan's tensor-parallel all-reduces (4 per layer and micro-batch) run at it; null:
    half the device table's NVLink figure (a ring sends each byte one way: H100 SXM 450), 1 on CPUs."""
    mfu: float | None = None
    """Planning: model FLOPs utilisation for the ETA at a large micro-batch (saturated matrix products; on
    GPUs the plan scales it down for this run's micro-batch by the efficiency curve measured in bench/);
    null: the figure measured in bench/ on this GPU at the micro-batch it was measured at (or, for a GPU
    not measured yet, on the one that was; the plan names the figure), 0.3 on CPUs."""
    reserved_memory_gb: float = 2.0
    """Planning: memory per device taken by the CUDA context, allocator fragmentation and communication
    buffers."""
    memory_headroom: float = 0.1
    """Planning: the share of a device's usable memory (device_memory_gb less reserved_memory_gb) the
    plan's estimate must leave free, its margin of error: a layout fits when the estimate is at most
    reserved + (1 − memory_headroom) × usable (80 GB, 3 reserved: 72.3 GB); 0: up to the last byte."""

    hardware_sources: dict[str, str] = field(default_factory=dict)
    """Written by launch.py, not a setting: where each hardware and layout value came from (site file,
    experiment, command line, default), and under "site" the site file; shown in the plan and recorded
    with the launch."""
    site_hardware: dict[str, Any] = field(default_factory=dict)
    """Written by launch.py, not a setting: the hardware values as the site file states them, against
    which the plan checks a command line's (orchestrator/base/site.py)."""

    def problems(self) -> list[ConfigIssue]:
        out = (positive("cluster.nodes", self.nodes)
               + positive("cluster.time_limit_min", self.time_limit_min)
               + choice("cluster.executor", self.executor, EXECUTORS))
        for name in ("gpus", "max_nodes", "cpus_per_node", "tasks_per_node"):
            out += positive(f"cluster.{name}", getattr(self, name), allow_none=True)
        for name in ("mem_per_node_gb", "device_peak_tflops", "bus_bandwidth_gbps",
                     "intra_node_bandwidth_gbps"):
            out += positive(f"cluster.{name}", getattr(self, name), allow_none=True)
        if self.stage_mem_gb is not None and self.stage_mem_gb < 0:
            out.append(issue("range", "cluster.stage_mem_gb", self.stage_mem_gb, "must be >= 0",
                             "cluster.stage_mem_gb=null (each stage's own figure), 0 (a whole node's) or GB"))
        if not 0 <= self.memory_headroom < 1:
            out.append(issue("range", "cluster.memory_headroom", self.memory_headroom, "must be in [0, 1)",
                             "a fraction such as cluster.memory_headroom=0.1 (0: no margin)"))
        if self.mfu is not None and not 0 < self.mfu <= 1:
            out.append(issue("range", "cluster.mfu", self.mfu, "must be in (0, 1]", "cluster.mfu=null "
                             "(the measured figure) or a fraction such as cluster.mfu=0.35"))
        return out


@dataclass
class ContainerConfig(Section):
    """The image jobs run in (see containers/README.md)."""

    kind: str = "none"
    """none (the submitting Python environment), apptainer (apptainer exec in each task), pyxis (srun
    --container-image: NVIDIA's pyxis/enroot Slurm plugin) or charliecloud (ch-run in each task)."""
    image: str | None = None
    """apptainer: path of the .sif image on shared storage (containers/build.sh builds one). pyxis: a
    squashfs file (containers/build_sqsh.sh builds one) or a registry reference to an image with
    Slipway's dependencies, as pyxis takes it: [USER@][REGISTRY#]IMAGE[:TAG], e.g.
    registry.example.org#team/slipway:1.0. charliecloud: the image's directory on shared storage
    (ch-convert makes one; containers/dev_image.py builds the CPU one the devcluster tests use)."""
    kernels_dir: str | None = "/opt/slipway/trainer"
    """Where the image's own build of the compiled kernels (the trainer package's _C library) is, inside
    the image: jobs load it and never the launched checkout's build, which was made on the host for
    another Python or torch (containers/README.md). The images containers/ builds have it there; null: the
    checkout's build, for an image whose Python and torch are the host's."""
    apptainer_bin: str = "apptainer"
    """The apptainer executable (a name on PATH or a path); pyxis needs none (it is srun's)."""
    charliecloud_bin: str = "ch-run"
    """The ch-run executable of the nodes (a name on PATH or a path)."""
    binds: list[str] = field(default_factory=list)
    """Extra host paths to bind (pyxis: mount); the code, runs_root, the cache, the data and tokenizer
    folders and the checkpoint folders are bound already. charliecloud binds onto folders the image has
    (the plan checks them; paths under /tmp need none)."""
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
    """Variables whose host values the jobs see inside the image (shell glob patterns), besides those
    cluster.env names. apptainer: forwarded into the --cleanenv container via APPTAINERENV_; charliecloud:
    the same, through ch-run --unset-env='*' and --set-env. pyxis passes the whole host environment but
    lets the image's own values win; these names go to --container-env, so the host's win."""
    env_denylist: list[str] = field(default_factory=lambda: ["*_TOKEN_PATH", "*_KEY_FILE", "WANDB_DIR"])
    """Never forwarded (pyxis: unset before srun) unless cluster.env names them: variables naming files
    that hold secrets on the host (not bound in the image)."""

    def problems(self) -> list[ConfigIssue]:
        return choice("container.kind", self.kind, CONTAINER_KINDS)


@dataclass
class ConvertConfig:
    """The post-training conversion to a Hugging Face model in <run_dir>/hf."""

    enabled: bool = True
    """Run the convert stage after training (afterok)."""
    verify: bool = True
    """Check the converted model against the checkpoint: logits within 1e-4, identical greedy generation."""


@dataclass
class AutotuneConfig(Section):
    """layout=auto: the space the plan searches for the parallel layout, and the short trial jobs that measure
    its best candidates (tune=true; orchestrator/planning/autolayout.py, orchestrator/stages/tune.py)."""

    candidates: int = 4
    """Trials: the layouts the plan ranks first are measured, this many (K of the Slurm job array
    --array=0-K-1%C; one after another on the local executor)."""
    concurrency: int = 1
    """Trials that run at once on Slurm (C of --array=0-K-1%C); each takes the run's whole allocation
    (cluster.nodes nodes), so raise it only where the partition has room for several."""
    warmup_iters: int = 10
    """Iterations of each trial before the measurement starts (compilation, allocator, caches); a
    multiple of log_interval."""
    iters: int = 20
    """Measured iterations of each trial (after warmup_iters); a multiple of log_interval."""
    log_interval: int = 5
    """Iterations per measured interval of a trial (the trainer's log interval in the trial)."""
    time_limit_min: int = 20
    """Wall-clock limit of one trial in minutes (the array's --time; on the local executor, per trial):
    a trial still running then is recorded as failed (time limit)."""
    hang_timeout_s: float = 300.0
    """A trial's train.hang_timeout_s: a trial that stops progressing this long is recorded as a hang."""
    micro_batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    """train.micro_batch_size values searched (those that divide the global batch per data-parallel
    rank)."""
    recompute: list[str] = field(default_factory=lambda: list(RECOMPUTE_CHOICES))
    """train.recompute_granularity values searched (full recomputes each layer: recompute_method
    uniform, recompute_num_layers 1)."""
    virtual_pp_sizes: list[int] = field(default_factory=lambda: [1, 2])
    """parallel.virtual_pp_size values searched where pp_size > 1 (interleaved 1F1B)."""
    distributed_optimizer: list[bool] = field(default_factory=lambda: [False, True])
    """optim.distributed values searched where dp > 1."""
    show: int = 10
    """Ranked layouts the plan prints (the dry run's table)."""

    def _normalise(self) -> None:
        self.micro_batch_sizes = [int(x) for x in self.micro_batch_sizes or []]
        self.recompute = [str(x) for x in self.recompute or []]
        self.virtual_pp_sizes = [int(x) for x in self.virtual_pp_sizes or []]
        self.distributed_optimizer = [bool(x) for x in self.distributed_optimizer or []]

    def problems(self) -> list[ConfigIssue]:
        out = []
        for name in ("candidates", "concurrency", "warmup_iters", "iters", "log_interval", "time_limit_min",
                     "hang_timeout_s", "show"):
            out += positive(f"autotune.{name}", getattr(self, name))
        if out:
            return out
        for name in ("warmup_iters", "iters"):
            if getattr(self, name) % self.log_interval:
                out.append(issue("interval", f"autotune.{name}", getattr(self, name),
                                 f"is not a multiple of autotune.log_interval={self.log_interval}",
                                 f"use a multiple of {self.log_interval}"))
        for name in ("micro_batch_sizes", "virtual_pp_sizes"):
            values = getattr(self, name)
            if not values or any(v < 1 for v in values):
                out.append(issue("positive", f"autotune.{name}", values, "must list integers >= 1",
                                 f"e.g. autotune.{name}=[1,2]"))
        bad = [r for r in self.recompute if r not in RECOMPUTE_CHOICES]
        if not self.recompute or bad:
            out.append(issue("choice", "autotune.recompute", self.recompute,
                             f"must list values of {', '.join(RECOMPUTE_CHOICES)}",
                             "autotune.recompute=[none,selective,full]"))
        if not self.distributed_optimizer:
            out.append(issue("choice", "autotune.distributed_optimizer", self.distributed_optimizer,
                             "must list true and/or false", "autotune.distributed_optimizer=[false,true]"))
        return out


@dataclass
class SlipwayConfig(RunConfig):
    """The root: the trainer's sections (trainer/config, the one definition of every trainer key) plus the
    orchestrator's own sections and launch switches."""

    experiment: str = "default"
    """Experiment name: the first level of the run directory (<runs_root>/<experiment>/<run_id>)."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Scheduler, resources and planning figures."""
    container: ContainerConfig = field(default_factory=ContainerConfig)
    """Container image."""
    convert: ConvertConfig = field(default_factory=ConvertConfig)
    """Post-training conversion."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation after conversion (trainer/eval/config.py): HumanEval pass@k and perplexity."""
    runs_root: str = "runs"
    """Folder that holds every run directory and the stage cache."""
    cache_dir: str | None = None
    """Content-addressed outputs of the shared stages (corpus, preprocess); null: <runs_root>/_cache."""
    dry_run: bool = False
    """Print the plan (layout, memory, ETA, stages, problems) and the job scripts; submit nothing. A sweep
    prints one point's plan in full, then a line per point with what sets it apart and its device-hours
    (sweep_plans)."""
    sweep_plans: str = "first"
    """What a sweep's dry run prints in full: first (the first point's plan and job scripts; the others as a
    line each: their overrides, the plan figures that differ from the first's, device-hours, ETA) or all
    (every point's)."""
    wait: bool | None = None
    """Block until the run ends; null: block for the local executor (its jobs are this machine's
    processes), return at once for Slurm and for sweeps."""
    layout: str = "manual"
    """manual: the parallel section's tp/pp/vpp, train.micro_batch_size, train.recompute_granularity and
    optim.distributed as set; auto: the plan searches those (autotune) for the layouts that fit the
    site's devices with the same world and global batch, ranks them by its step-time estimate and takes
    the first (with tune=true: the fastest of its trials). docs/cluster.md, "Choosing the layout"."""
    tune: str = "false"
    """layout=auto: false (train with the plan's first choice); true (short trial jobs measure the
    autotune.candidates best-ranked layouts after preprocessing, and training starts with the fastest;
    a relaunch reuses that decision, <run_dir>/tune/); force (measure again even where a decision
    exists)."""
    autotune: AutotuneConfig = field(default_factory=AutotuneConfig)
    """layout=auto's search space and trials."""

    def _normalise(self) -> None:
        # run_dir and checkpoint.dir stay null until the plan knows the run id (plan.py). A command line's
        # tune=true arrives as a YAML boolean, which the str field holds as "True".
        self.tune = str(self.tune).lower()

    def problems(self) -> list[ConfigIssue]:
        return (super().problems() + self.cluster.problems() + self.container.problems()
                + self.eval.problems() + self.autotune.problems()
                + choice("layout", self.layout, LAYOUT_MODES)
                + choice("tune", self.tune, TUNE_MODES)
                + choice("sweep_plans", self.sweep_plans, SWEEP_PLANS))


def register() -> None:
    """Register the schema; group YAMLs extend it through the primary config's defaults list."""
    cs = ConfigStore.instance()
    with declared_defaults():  # derived defaults are derived from the composed config, in to_typed
        cs.store(name="slipway_schema", node=SlipwayConfig)


def to_typed(cfg: Any, choices: dict[str, Any] | None = None) -> SlipwayConfig:
    """OmegaConf DictConfig (composed) → plain, resolved SlipwayConfig dataclass tree.

    ``choices``: Hydra's group choices (``hydra.runtime.choices``), used for names a group file omits.
    Raises :class:`PlanError` for keys the schema does not have (``+optim.lrr=3e-4``).
    """
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig) and (unknown := unknown_keys(cfg)):
        raise PlanError([Problem(i.code, i.key, i.value, i.message, i.fix) for i in unknown])
    # Sections record instead of raising here, so the checks report every problem at once.
    with deferred():
        obj = OmegaConf.to_object(cfg)
        if not isinstance(obj, SlipwayConfig):  # composed without the schema (e.g. a bare dict in a test)
            with declared_defaults():
                schema = OmegaConf.structured(SlipwayConfig)
            obj = OmegaConf.to_object(OmegaConf.merge(schema, cfg))
    if obj.cluster.name is None:
        obj.cluster.name = str((choices or {}).get("cluster") or obj.cluster.executor)
    return obj  # type: ignore[return-value]
