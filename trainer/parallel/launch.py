"""Initialise torch.distributed from the environment a launcher provides and build the ParallelState.

Recognised, in this order: torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); Slurm with
one task per GPU under srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_NODELIST: the first
host is the master, the port is MASTER_PORT or derived from SLURM_JOB_ID); otherwise a single process,
which needs no process group at all. Backend: NCCL when an accelerator is present, else gloo.
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.config.model import ParallelConfig
from trainer.formulas import PORT_BASE, PORT_SPAN, master_port
from trainer.log import get_logger
from trainer.parallel.state import ParallelState, check_layout

log = get_logger(__name__)


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, as the launcher says."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str
    """'torchrun', 'slurm' or 'single'."""


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist: 'gpu[03-05,9],cpu1' → 'gpu03'; 'r[1-2]-n[7-8]' → 'r1-n7'."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    return re.sub(r"\[([^\]]+)\]", lambda m: m.group(1).split(",")[0].split("-")[0], nodelist[:end])


def dist_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read rank, world size and rendezvous address from torchrun's or Slurm's variables."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                       env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        port = int(env["MASTER_PORT"]) if "MASTER_PORT" in env else \
            master_port(int(env.get("SLURM_JOB_ID", "0")))
        return DistEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                       env.get("MASTER_ADDR") or first_host(nodelist), port, "slurm")
    return DistEnv(0, 1, 0, "127.0.0.1", 0, "single")


def cpu_threads_per_rank(local_world_size: int, environ: Mapping[str, str] | None = None) -> int | None:
    """Intra-op threads for one of ``local_world_size`` ranks sharing this node's cores, or None to keep
    torch's default (OMP_NUM_THREADS given, or nothing to share).

    torch starts one OpenMP thread per core in every process. With several ranks per node (CPU/gloo
    training, or the CPU side of GPU ranks) the pools oversubscribe the cores and OpenMP's spin-waiting
    threads steal them from each other: 4 ranks of a tiny GPT on 2 cores ran 10x slower (3 s instead of
    0.3 s per iteration). torchrun sets OMP_NUM_THREADS=1 for the same reason; Slurm and submitit do not.
    """
    env = os.environ if environ is None else environ
    if env.get("OMP_NUM_THREADS"):
        return None
    # Slurm gave this task its CPUs: that is its share even as the only task of its node, since other
    # jobs may share the node (and the devcluster's two nodes share one machine's cores).
    if env.get("SLURM_CPUS_PER_TASK", "").isdigit():
        return max(1, int(env["SLURM_CPUS_PER_TASK"]))
    if local_world_size <= 1:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // local_world_size)


def _local_world_size(env: Mapping[str, str], world_size: int) -> int:
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        if env.get(key, "").isdigit():
            return int(env[key])
    return world_size if env.get("SLURM_NNODES", "1") == "1" else 1


def _accelerator() -> torch.device | None:
    acc = getattr(torch, "accelerator", None)
    if acc is not None:
        return acc.current_accelerator() if acc.is_available() else None
    return torch.device("cuda") if torch.cuda.is_available() else None  # torch < 2.6


def init_distributed(pcfg: ParallelConfig, backend: str | None = None, timeout_s: float = 1800.0,
                     environ: Mapping[str, str] | None = None,
                     before: Callable[[DistEnv, str], object] | None = None) -> ParallelState:
    """Initialise the process group (if the world has more than one rank) and lay out the grid.

    ``backend``: 'nccl' or 'gloo' to force one; by default NCCL on GPUs, gloo on CPUs. ``before(env,
    backend)`` runs just before the rendezvous of a multi-rank world (the start-up preflight's checks of
    it, trainer/health/rendezvous.py): what it raises ends the start instead of a rendezvous timeout.
    """
    env = dist_env(environ)
    local_ranks = _local_world_size(os.environ if environ is None else environ, env.world_size)
    threads = cpu_threads_per_rank(local_ranks, environ)
    if threads is not None and threads < torch.get_num_threads():
        log.info("%d intra-op thread(s) per rank: %d ranks share this node's cores (OMP_NUM_THREADS "
                 "overrides)", threads, local_ranks)
        torch.set_num_threads(threads)
    check_layout(env.world_size, pcfg.tp_size, pcfg.pp_size)
    accel = _accelerator()
    backend = backend or ("nccl" if accel is not None and accel.type == "cuda" else "gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device(accel.type, env.local_rank)
        torch.get_device_module(accel.type).set_device(device)
    if env.world_size == 1:
        return ParallelState.single(device)
    if not dist.is_initialized():
        if before is not None:
            before(env, backend)
        _init_process_group(backend, env, timeout_s)
    pstate = ParallelState.build(pcfg.tp_size, pcfg.pp_size, device=device)
    log.info("torch.distributed %s from %s: world %d = tp %d × pp %d × dp %d", backend, env.source,
             env.world_size, pstate.tp_size, pstate.pp_size, pstate.dp_size)
    return pstate


def _init_process_group(backend: str, env: DistEnv, timeout_s: float) -> None:
    try:
        dist.init_process_group(backend, init_method=f"tcp://{env.master_addr}:{env.master_port}",
                                rank=env.rank, world_size=env.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    except dist.DistNetworkError as e:
        if "EADDRINUSE" not in str(e):
            raise
        raise RuntimeError(
            f"rank {env.rank}: the rendezvous port {env.master_port} on {env.master_addr} is held by another "
            f"process (ranks found by {env.source}; MASTER_PORT, or {PORT_BASE} + job id mod {PORT_SPAN}). "
            "Set cluster.env.MASTER_PORT to a port that is free on the first node, below the ephemeral range "
            "(/proc/sys/net/ipv4/ip_local_port_range), and relaunch") from e
