"""The cluster the run is planned for: what its devices can do (precision, the eval device, the backend),
the local executor's one machine, and the time limit — against the signal lead, and against the plan's
estimate of when the first checkpoint is due (this rule reads the time estimate, but what it protects,
and what the fix changes, is the cluster's time limit, beside the signal-lead rule on the same key)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.problems import Problem
from orchestrator.queue import controller_unreachable

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
