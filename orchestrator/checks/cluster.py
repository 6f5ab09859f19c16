"""The cluster the run is planned for: what its devices can do (precision, the eval device, the backend),
the local executor's one machine, its Slurm partitions' nodes (sinfo, when Slurm answers), and the time
limit — against the signal lead, and against the plan's
estimate of when the first checkpoint is due (this rule reads the time estimate, but what it protects,
and what the fix changes, is the cluster's time limit, beside the signal-lead rule on the same key)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator import sinfo
from orchestrator.problems import Problem

if TYPE_CHECKING:
    from orchestrator.checks import Context


def precision_problems(ctx: Context) -> list[Problem]:
    prec, c = ctx.cfg.train.precision, ctx.cfg.cluster
    if prec == "fp16" and c.gpus_per_node == 0:
        return [
            Problem(
                "precision",
                "train.precision",
                prec,
                f"fp16 mixed precision needs CUDA; cluster.{c.name} has no GPUs",
                "use train.precision=fp32 (or bf16) on CPU clusters",
            )
        ]
    if prec == "bf16" and not c.device_bf16:
        return [
            Problem(
                "precision",
                "train.precision",
                prec,
                f"cluster device {c.device_name} has no bf16 support (cluster.device_bf16=false)",
                "use train.precision=fp16 on pre-Ampere GPUs",
            )
        ]
    return []


def cluster_problems(ctx: Context) -> list[Problem]:
    c, out = ctx.cfg.cluster, []
    if c.executor == "local" and c.nodes != 1:
        out.append(
            Problem(
                "local_nodes",
                "cluster.nodes",
                c.nodes,
                "the local executor runs on one machine",
                "use cluster.nodes=1, or cluster=devcluster / cluster=slurm for several nodes",
            )
        )
    backend = c.backend or ("nccl" if c.gpus_per_node else "gloo")
    if backend == "nccl" and c.gpus_per_node == 0:
        out.append(
            Problem(
                "backend",
                "cluster.backend",
                backend,
                "NCCL needs GPUs; this cluster has none",
                "set cluster.backend=gloo (or null)",
            )
        )
    if c.signal_delay_s >= c.time_limit_min * 60:
        out.append(
            Problem(
                "signal_lead",
                "cluster.signal_delay_s",
                c.signal_delay_s,
                f"not shorter than the time limit ({c.time_limit_min} min)",
                "lower cluster.signal_delay_s or raise cluster.time_limit_min",
            )
        )
    return out


def eval_device_problems(ctx: Context) -> list[Problem]:
    """The eval stage's rule that needs the cluster (its own are EvalConfig.problems())."""
    cfg = ctx.cfg
    e = cfg.eval
    if not e.enabled or not cfg.convert.enabled:  # no conversion, no eval stage (the plan warns)
        return []
    if e.device == "cuda" and cfg.cluster.gpus_per_node == 0:
        return [Problem("eval_device", "eval.device", e.device,
                        f"cluster {cfg.cluster.name} has no GPUs (cluster.gpus_per_node=0)",
                        "set eval.device=cpu")]
    return []


def time_limit_problems(ctx: Context) -> list[Problem]:
    """The first checkpoint must be due before the time limit (less the signal lead): a job stopped before
    it has saved nothing to resume from."""
    c, t = ctx.cfg.cluster, ctx.cfg.train
    if ctx.estimates is None:  # the layout gives no estimate: the layout checks say why
        return []
    est = ctx.estimates.time
    usable = c.time_limit_min * 60 - c.signal_delay_s
    if not t.save_interval or est.first_checkpoint_s <= usable:
        return []
    per_iter = est.step_s
    fit = max(int(usable / per_iter), 0) if per_iter > 0 else 0
    need_min = int((est.first_checkpoint_s + c.signal_delay_s) / 60) + 1
    return [
        Problem(
            "time_limit",
            "cluster.time_limit_min",
            c.time_limit_min,
            f"the first checkpoint (train.save_interval={t.save_interval}) is due after "
            f"~{est.first_checkpoint_s / 60:.0f} min but the job has {usable / 60:.0f} min",
            f"raise cluster.time_limit_min to >= {need_min} or lower train.save_interval to <= {fit}",
        )
    ]


def partition_problems(ctx: Context) -> list[Problem]:
    """On Slurm, when it answers here (sinfo): the partitions exist and have nodes that can hold the jobs,
    with their GPUs, CPUs and memory per node. A job no node can hold is refused by sbatch half-way
    through the launch (its upstream jobs already queued) or, where the partition's nodes exist but are
    down or drained, left pending forever."""
    c = ctx.cfg.cluster
    parts = sinfo.partitions() if c.executor == "slurm" else None
    if not parts:
        return []
    out: list[Problem] = []
    train = _partition(parts, "cluster.partition", c.partition, out)
    if train is not None:
        lay = ctx.layout
        out += _fit(train, ("cluster.gpus_per_node", c.gpus_per_node), lay.tasks_per_node, c.cpus_per_task,
                    c.mem_gb, lay.nodes)
    key, name = ("cluster.stage_partition", c.stage_partition) if c.stage_partition else (
        "cluster.partition", c.partition)
    stage = train if name == c.partition else _partition(parts, key, name, out)
    if stage is not None and c.stage_cpus > stage.max_cpus:
        out.append(Problem("partition_cpus", "cluster.stage_cpus", c.stage_cpus,
                           f"the nodes of partition {stage.name} have at most {stage.max_cpus} CPUs (sinfo)",
                           f"set cluster.stage_cpus <= {stage.max_cpus}"))
    return out


def _partition(parts: dict[str, sinfo.Partition], key: str, name: str | None,
               out: list[Problem]) -> sinfo.Partition | None:
    """The partition ``name`` (None: Slurm's default), or None with a problem appended when there is none."""
    found = parts.get(name) if name else next((p for p in parts.values() if p.default), None)
    if found is None and name:
        out.append(Problem("partition_unknown", key, name, f"Slurm has no partition {name} (sinfo lists "
                           f"{', '.join(sorted(parts))})", f"set {key} to one of them"))
    return found


def _fit(part: sinfo.Partition, gpus: tuple[str, int], tasks: int, cpus_per_task: int,
         mem_gb: float | None, nodes: int) -> list[Problem]:
    """The training job's per-node request against the partition's nodes: the first resource no node has
    enough of, else too few nodes that have enough of all of them."""
    key, want_gpus = gpus
    cpus, mem_mb = tasks * cpus_per_task, int((mem_gb or 0) * 1024)
    where = f"the nodes of partition {part.name}"
    if want_gpus > part.max_gpus:
        have = f"have at most {part.max_gpus} GPUs" if part.max_gpus else "have no GPUs (gres/gpu)"
        return [Problem("partition_gpus", key, want_gpus, f"{where} {have} (sinfo): Slurm would refuse the "
                        "job or leave it pending", f"set {key} <= {part.max_gpus}, or a partition with more "
                        "GPUs per node (cluster.partition)")]
    if cpus > part.max_cpus:
        return [Problem("partition_cpus", "cluster.cpus_per_task", cpus_per_task,
                        f"{tasks} task(s) x {cpus_per_task} CPUs = {cpus} per node; {where} have at most "
                        f"{part.max_cpus} (sinfo)", "lower cluster.cpus_per_task (or the tasks per node)")]
    if mem_mb > part.max_memory_mb:
        return [Problem("partition_memory", "cluster.mem_gb", mem_gb,
                        f"{where} have at most {part.max_memory_mb // 1024} GB (sinfo)",
                        "lower cluster.mem_gb (0: all of a node's)")]
    fit = [n for n in part.nodes if n.gpus >= want_gpus and n.cpus >= cpus and n.memory_mb >= mem_mb]
    if len(fit) < nodes:
        return [Problem("partition_nodes", "cluster.nodes", nodes,
                        f"of {where}, {len(fit)} can hold a node's share of the job ({want_gpus} GPUs, "
                        f"{cpus} CPUs, {mem_mb} MB) (sinfo)",
                        f"set cluster.nodes <= {len(fit)}, or another partition")]
    return []
