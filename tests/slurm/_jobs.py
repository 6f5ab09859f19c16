"""Functions that run inside Slurm jobs submitted by the tests (importable by the job's interpreter)."""

from __future__ import annotations

import datetime
import os


def allreduce_rank() -> dict:
    """Join a gloo process group from the Slurm environment and all-reduce ``rank + 1``."""
    import submitit
    import torch
    import torch.distributed as dist

    from trainer.formulas import master_port

    # submitit would pick the port anywhere in 20000-60000, ephemeral ports included (CI once lost this
    # test to EADDRINUSE on 38028); the product's formula keeps below that range.
    env = submitit.helpers.TorchDistributedEnvironment()
    env.master_port = master_port(int(os.environ["SLURM_JOB_ID"]))
    env.export(set_cuda_visible_devices=False)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        value = torch.tensor([float(env.rank + 1)])
        dist.all_reduce(value)
        return {"rank": env.rank, "world_size": env.world_size, "local_rank": env.local_rank,
                "sum": value.item(), "node": os.environ["SLURMD_NODENAME"], "master_addr": env.master_addr,
                "master_port": int(os.environ["MASTER_PORT"])}
    finally:
        dist.destroy_process_group()
