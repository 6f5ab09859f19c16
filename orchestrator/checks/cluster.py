"""The cluster the run is planned for: what its devices can do (precision, the eval device, the backend),
the local executor's one machine (and a site file that names Slurm's partition but runs on it), the
site's hardware against what the run asks of it (orchestrator/base/hardware.py: nodes, GPUs, CPUs and
memory per node, a device the plan can estimate, one task per GPU), the controller answering (what Slurm
itself says of the jobs is checks/slurm.py's), and the time limit — against the signal lead, and against
the plan's estimate of when the first checkpoint is due (this rule reads the time estimate, but what it
protects, and what the fix changes, is the cluster's time limit, beside the signal-lead rule on the same
key)."""

from __future__ import annotations

import re
from typing import Any

from orchestrator.base.hardware import HARDWARE, hardware, is_cpu, source
from orchestrator.base.plan_types import Context
from orchestrator.base.problems import Problem
from orchestrator.base.schema import ClusterConfig
from orchestrator.world.queue import controller_unreachable
from trainer.devices import known_names


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
    if prec == "bf16" and not hardware(ctx.cfg).bf16.value:
        return [
            Problem(
                "precision",
                "train.precision",
                prec,
                f"cluster device {c.device_name} has no bf16 support (cluster.device_bf16: "
                f"{hardware(ctx.cfg).bf16.source})",
                "use train.precision=fp16 on pre-Ampere GPUs",
            )
        ]
    return []


# Keys that mean something only to Slurm: a config that sets one and runs locally lost its `executor: slurm`.
_SLURM_KEYS = ("partition", "stage_partition", "account", "qos", "constraint", "sbatch_extra")


def _slurm_only(c: ClusterConfig) -> Problem | None:
    """A site file that names Slurm's partition, account or QoS but left out ``defaults: [slurm]`` (or
    ``executor: slurm``) runs on the local executor: on the login node."""
    named = [f"cluster.{k}={getattr(c, k)}" for k in _SLURM_KEYS if getattr(c, k)]
    if c.executor != "local" or not named:
        return None
    site = _site_file(c)
    return Problem("executor", "cluster.executor", c.executor,
                   f"{site} names Slurm's {', '.join(named)} but has no `executor: slurm`: the local "
                   "executor would run every job on this machine (the login node), not on the cluster",
                   f"start {site} from slurm.yaml (`defaults: [slurm, _self_]`, docs/cluster.md step 2) or "
                   "add `executor: slurm` to it")


def cluster_problems(ctx: Context) -> list[Problem]:
    c, out = ctx.cfg.cluster, []
    slurm_only = _slurm_only(c)
    if slurm_only is not None:  # the root cause: a fix of the node count would be the wrong one
        out.append(slurm_only)
    elif c.executor == "local" and c.nodes != 1:
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
    out += [Problem("env_name", f"cluster.env.{k}", v, "is not a variable name (letters, digits and _, not "
                    "starting with a digit): the job scripts export it and forward it into the container by "
                    "name", "rename it") for k, v in c.env.items() if not _VAR_NAME.fullmatch(str(k))]
    port = str(c.env.get("MASTER_PORT", "1024"))
    if not (port.isdigit() and 1024 <= int(port) <= 65535):  # the trainer would fail on it in every task
        out.append(Problem("master_port", "cluster.env.MASTER_PORT", port, "not a port from 1024 to 65535",
                           "give a port that is free on the job's first node, below its ephemeral range "
                           "(/proc/sys/net/ipv4/ip_local_port_range), or drop it to use the job id's"))
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


_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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
    if ctx.estimates is None or not ctx.estimates.time.known:  # the layout or device checks say why
        return []
    est = ctx.estimates.time
    usable = c.time_limit_min * 60 - c.signal_delay_s
    if not t.save_interval or est.first_checkpoint_s <= usable:
        return []
    per_iter = est.step_s
    fit = int(usable / per_iter) if per_iter > 0 else 0
    need_min = int((est.first_checkpoint_s + c.signal_delay_s) / 60) + 1
    if fit >= 1:
        fix = (f"raise cluster.time_limit_min to >= {need_min}, or lower train.save_interval to <= {fit} "
               f"(a checkpoint every ~{fit * per_iter / 60:.0f} min)")
    else:  # not one iteration fits: a shorter save interval cannot help
        fix = (f"raise cluster.time_limit_min to >= {need_min} (one iteration takes ~{per_iter / 60:.0f} "
               f"min, the job has {usable / 60:.0f} after the signal lead), or spread the run over more "
               f"GPUs (cluster.gpus / cluster.nodes)")
    return [
        Problem(
            "time_limit",
            "cluster.time_limit_min",
            c.time_limit_min,
            f"the first checkpoint (train.save_interval={t.save_interval}) is due after "
            f"~{est.first_checkpoint_s / 60:.0f} min but the job has {usable / 60:.0f} min",
            fix,
        )
    ]


# Hardware counts a command line may lower (asking for less than the site has) but not raise.
_COUNTS = ("max_nodes", "gpus_per_node", "cpus_per_node", "mem_per_node_gb")


def _site_file(c: ClusterConfig) -> str:
    return c.hardware_sources.get("site", f"cluster/{c.name}.yaml")


def _over_the_site(c: ClusterConfig, key: str, site: Any) -> Problem | None:
    """A command line's hardware value against the site file's (launch.py records both)."""
    value = getattr(c, key)
    if value == site or (key in _COUNTS and value is not None and site is not None and value < site):
        return None
    if key == "gpus_per_node":
        fix = (f"drop cluster.gpus_per_node; ask for more GPUs with whole nodes: cluster.gpus="
               f"{c.nodes * value} ({-(-c.nodes * value // max(site, 1))} nodes of {site})")
    else:
        fix = f"drop cluster.{key} from the command line; other hardware is another site (cluster=<site>)"
    what = "has no more" if key in _COUNTS else "is what the site has"
    return Problem("site_hardware", f"cluster.{key}", value,
                   f"set on the command line, but the site file {_site_file(c)} says {site} (hardware: the "
                   f"site {what})", fix)


def _size_problems(c: ClusterConfig) -> list[Problem]:
    """The job's size in nodes and GPUs against the site's (cluster.gpus: orchestrator/base/site.py)."""
    out, per_node = [], c.gpus_per_node
    if c.gpus is not None:
        if not per_node:
            out.append(Problem(
                "gpus", "cluster.gpus", c.gpus, f"asks for GPUs ({source(c, 'gpus')}) but the site's nodes "
                f"have none (cluster.gpus_per_node=0, {source(c, 'gpus_per_node')})",
                "cluster.gpus=null (CPU tasks: cluster.nodes, cluster.tasks_per_node), or a GPU site "
                "(cluster=<site>)"))
        elif c.gpus % per_node:
            lower, upper = c.gpus // per_node * per_node, -(-c.gpus // per_node) * per_node
            out.append(Problem("gpus", "cluster.gpus", c.gpus, f"is not a whole number of the site's nodes "
                               f"of {per_node} GPUs ({source(c, 'gpus_per_node')})",
                               f"cluster.gpus={lower or per_node} or cluster.gpus={upper}"))
        elif c.nodes * per_node != c.gpus:
            out.append(Problem(
                "gpus", "cluster.gpus", c.gpus, f"asks for {c.gpus} GPUs ({source(c, 'gpus')}) but "
                f"cluster.nodes={c.nodes} ({source(c, 'nodes')}) gives {c.nodes * per_node}",
                "give one of them: cluster.gpus=null, or drop cluster.nodes"))
    if c.max_nodes is not None and c.nodes > c.max_nodes:
        key = "cluster.gpus" if c.gpus is not None else "cluster.nodes"
        fix = (f"cluster.gpus={c.max_nodes * per_node}" if c.gpus is not None and per_node
               else f"cluster.nodes={c.max_nodes}")
        out.append(Problem("max_nodes", key, c.gpus if c.gpus is not None else c.nodes,
                           f"needs {c.nodes} nodes ({source(c, 'nodes')}); the site has {c.max_nodes} "
                           f"(cluster.max_nodes, {source(c, 'max_nodes')})", f"{fix}, at most the site's"))
    return out


def _node_problems(c: ClusterConfig, tasks: int) -> list[Problem]:
    """CPUs and memory asked of one node against what it has."""
    out = []
    if c.cpus_per_node is not None and tasks * c.cpus_per_task > c.cpus_per_node:
        out.append(Problem("node_cpus", "cluster.cpus_per_task", c.cpus_per_task,
                           f"{tasks} tasks × {c.cpus_per_task} CPUs = {tasks * c.cpus_per_task} per node; "
                           f"the site's nodes have {c.cpus_per_node} ({source(c, 'cpus_per_node')})",
                           f"cluster.cpus_per_task={max(c.cpus_per_node // max(tasks, 1), 1)}"))
    if c.cpus_per_node is not None and c.stage_cpus > c.cpus_per_node:
        out.append(Problem("node_cpus", "cluster.stage_cpus", c.stage_cpus, f"more than the site's nodes "
                           f"have ({c.cpus_per_node}, {source(c, 'cpus_per_node')})",
                           f"cluster.stage_cpus={c.cpus_per_node}"))
    if c.mem_per_node_gb is not None and c.mem_gb and c.mem_gb > c.mem_per_node_gb:
        out.append(Problem("node_memory", "cluster.mem_gb", c.mem_gb, f"more than the site's nodes have "
                           f"({c.mem_per_node_gb:g} GB, {source(c, 'mem_per_node_gb')})",
                           "cluster.mem_gb=0 (all of a node's memory) or a value within it"))
    return out


def _device_problems(ctx: Context) -> list[Problem]:
    """A GPU site must name a device the plan can estimate: one the table knows, or its peak given."""
    c = ctx.cfg.cluster
    if not c.gpus_per_node:
        return []
    if is_cpu(c):
        return [Problem("device", "cluster.device_name", c.device_name, f"the site has GPUs "
                        f"(cluster.gpus_per_node={c.gpus_per_node}) but names no device "
                        f"({source(c, 'device_name')})", f"set device_name in the site file {_site_file(c)}, "
                        f"one of: {known_names()}")]
    hw = hardware(ctx.cfg)
    if hw.peak_tflops.value is None and hw.gpu is None:
        return [Problem("device", "cluster.device_name", c.device_name,
                        "is not in the device table (trainer/devices.py) and cluster.device_peak_tflops is "
                        "not set: the plan cannot estimate the run's time (nor check its memory without "
                        "cluster.device_memory_gb)",
                        f"set device_peak_tflops (the datasheet's dense {ctx.cfg.train.precision} TFLOP/s, "
                        f"without sparsity) and device_memory_gb in the site file {_site_file(c)}, or use a "
                        f"name the table knows: {known_names()}")]
    return []


def site_problems(ctx: Context) -> list[Problem]:
    """What the run asks of the site against the site's hardware: a command line's hardware over the site
    file's, the job's size, CPUs and memory per node, and a device the plan can estimate."""
    c = ctx.cfg.cluster
    out = [p for key in HARDWARE if key in c.site_hardware and source(c, key) == "command line"
           if (p := _over_the_site(c, key, c.site_hardware[key])) is not None]
    return out + _size_problems(c) + _node_problems(c, ctx.layout.tasks_per_node) + _device_problems(ctx)


def task_problems(ctx: Context) -> list[Problem]:
    """On GPUs the trainer runs one rank per GPU (its local rank picks the device): more tasks than GPUs
    fail at start, fewer leave GPUs idle that the job holds."""
    c = ctx.cfg.cluster
    if not c.gpus_per_node or c.tasks_per_node is None or c.tasks_per_node == c.gpus_per_node:
        return []
    what = ("ranks without a GPU of their own fail at start" if c.tasks_per_node > c.gpus_per_node
            else f"{c.gpus_per_node - c.tasks_per_node} GPUs per node would idle, held by the job")
    return [Problem("tasks_per_node", "cluster.tasks_per_node", c.tasks_per_node,
                    f"differs from the {c.gpus_per_node} GPUs per node ({source(c, 'gpus_per_node')}): the "
                    f"trainer runs one rank per GPU, so {what}",
                    "cluster.tasks_per_node=null (one task per GPU); for fewer GPUs ask cluster.gpus")]


def controller_problems(ctx: Context) -> list[Problem]:
    """A Slurm cluster's controller must answer before anything is recorded or submitted (the dry run
    asks too): otherwise the first ``sbatch`` fails with submitit's traceback."""
    c = ctx.cfg.cluster
    if c.executor != "slurm":
        return []
    why = controller_unreachable()
    if not why:
        return []
    return [Problem("slurm_unreachable", "cluster", c.name, f"the Slurm controller does not answer ({why})",
                    "check that slurmctld runs (scontrol ping) and that this machine's SLURM_CONF names its "
                    "slurm.conf; or launch with cluster=local to run on this machine")]
