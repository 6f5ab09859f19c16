"""What Slurm itself says of the jobs, where it answers: the partitions (sinfo) exist and have nodes that
can hold each job, with their GPUs, CPUs and memory, and allow its time limit (MaxTime); the account and
QoS are the user's (sacctmgr, where accounting runs: orchestrator/world/accounting.py). What the site file
claims is checked against what the scheduler reports (checks/cluster.py checks the claims themselves)."""

from __future__ import annotations

import difflib

from orchestrator.base.plan_types import Context
from orchestrator.base.problems import Problem
from orchestrator.base.schema import ClusterConfig, SlipwayConfig
from orchestrator.stages import STAGES
from orchestrator.stages.base import stage_mem_gb
from orchestrator.world import accounting, sinfo


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
    if stage is not None:
        out += _stage_memory(ctx, stage)
    return out + _time_problems(ctx.cfg, parts)


def _stage_memory(ctx: Context, part: sinfo.Partition) -> list[Problem]:
    """The largest single-task stage job's --mem (of the plan's stages, when there is a plan) against the
    stage partition's nodes."""
    planned = {s.name for s in ctx.plan.stages} if ctx.plan is not None else None
    asks = {s.name: stage_mem_gb(ctx.cfg, s) for s in STAGES
            if s.stage_job and (planned is None or s.name in planned)}
    if not asks:
        return []
    name, gb = max(asks.items(), key=lambda kv: kv[1])
    have = part.max_memory_mb // 1024
    if gb * 1024 <= part.max_memory_mb:
        return []
    whose = ("cluster.stage_mem_gb" if ctx.cfg.cluster.stage_mem_gb is not None
             else "its own figure, docs/config.md")
    return [Problem("partition_memory", "cluster.stage_mem_gb", gb, f"the {name} job asks for {gb:g} GB "
                    f"({whose}); the nodes of partition {part.name} have at most {have} GB (sinfo)",
                    f"set cluster.stage_mem_gb <= {have}, or a partition with more memory per node "
                    "(cluster.stage_partition)")]


def _time_problems(cfg: SlipwayConfig, parts: dict[str, sinfo.Partition]) -> list[Problem]:
    """Each job's time limit against its partition's MaxTime (sinfo): with the partition's limits enforced
    sbatch refuses a longer job, otherwise Slurm leaves it pending for ever (reason PartitionTimeLimit)."""
    c = cfg.cluster
    stage_part = c.stage_partition or c.partition
    jobs = [("cluster.time_limit_min", c.time_limit_min, c.partition),
            ("cluster.stage_time_limit_min", c.stage_time_limit_min, stage_part)]
    if cfg.eval.enabled and cfg.convert.enabled:
        jobs.append(("eval.time_limit_min", cfg.eval.time_limit_min,
                     c.partition if cfg.eval.device == "cuda" else stage_part))
    if cfg.layout == "auto" and cfg.tune != "false":
        jobs.append(("autotune.time_limit_min", cfg.autotune.time_limit_min, c.partition))
    out = []
    for key, minutes, name in jobs:
        part = parts.get(name) if name else next((p for p in parts.values() if p.default), None)
        if part is None or part.max_time_min is None or minutes <= part.max_time_min:
            continue
        out.append(Problem("time_limit", key, minutes, f"exceeds partition {part.name}'s MaxTime "
                           f"{part.max_time_min} min (sinfo): Slurm would refuse the job or leave it pending",
                           f"set {key}<={part.max_time_min} or pick a partition with a longer limit"))
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


def account_problems(ctx: Context) -> list[Problem]:
    """On Slurm, where accounting runs: cluster.account is one of the user's associations (for the
    partitions the jobs use) and cluster.qos one that association allows (sacctmgr). Where accounting does
    not answer, a note in the plan's warnings says they were not checked."""
    c = ctx.cfg.cluster
    if c.executor != "slurm" or not (c.account or c.qos):
        return []
    user = accounting.user_name()
    found = accounting.associations(user)
    if isinstance(found, str):
        if ctx.plan is not None:
            named = " and ".join(f"cluster.{k}={getattr(c, k)}" for k in ("account", "qos") if getattr(c, k))
            ctx.plan.warnings.append(f"{named} not checked: Slurm's accounting did not answer ({found}); "
                                     "sbatch accepts or refuses them")
        return []
    return _association_problems(c, user, found)


def _association_problems(c: ClusterConfig, user: str, found: list[accounting.Association]) -> list[Problem]:
    mine = sorted({a.account for a in found})
    usable = found
    if c.account:
        usable = [a for a in found if a.account == c.account.lower()]
        if not usable:
            close = difflib.get_close_matches(c.account.lower(), mine, n=1, cutoff=0.5) or mine[:1]
            fix = (f"set cluster.account={close[0]}" if close else
                   "ask the site's Slurm administrators for an association (sacctmgr add user)")
            return [Problem("account", "cluster.account", c.account, f"no association for user {user} with "
                            f"this account (sacctmgr); yours: {', '.join(mine) or 'none'}", fix)]
        for part in dict.fromkeys(p for p in (c.partition, c.stage_partition) if p):
            if not any(not a.partition or a.partition == part.lower() for a in usable):
                where = ", ".join(sorted(a.partition for a in usable))
                return [Problem("account", "cluster.account", c.account, f"user {user}'s association with "
                                f"this account is for partition(s) {where}, not {part} (sacctmgr)",
                                "use one of those partitions or another of your accounts: "
                                + ", ".join(mine))]
    allowed = sorted({q for a in usable for q in a.qos})
    if c.qos and c.qos.lower() not in allowed:
        whose = (f"user {user}'s association with account {c.account}" if c.account
                 else f"user {user}'s associations")
        close = difflib.get_close_matches(c.qos.lower(), allowed, n=1, cutoff=0.5)
        fix = (f"set cluster.qos={close[0]}" if close
               else "set cluster.qos to one of them, or null (the association's default)" if allowed
               else "set cluster.qos=null")
        return [Problem("qos", "cluster.qos", c.qos, f"is not a QoS of {whose} (sacctmgr): "
                        f"{', '.join(allowed) or 'none'}", fix)]
    return []
