"""Goodput: how much of a run's allocated time trained, and where the rest went (issue 53). Torch-free:
the trainer writes the records, ``python -m orchestrator status`` and the summary read them on the login
node, and W&B gets the same figures from the trainer.

Every training attempt (one process of global rank 0: one ``srun`` step of the job script, a retry, a
requeued job's new start) keeps one record, ``<run_dir>/goodput/<start>_<job>_r<restart>_a<attempt>.json``
(:class:`trainer.run_files.RunDir`), rewritten atomically at every heartbeat, after its first step, after
each save and at its end (:mod:`~trainer.goodput.clock`). A killed attempt therefore still counts what it
did up to its last record. The accounting over all records of a run is :mod:`~trainer.goodput.account`.

The terms, defined here once:

- **allocation**: the attempts that share a Slurm job id and restart count (``SLURM_RESTART_COUNT``): one
  start of the job, from Slurm granting it to its requeue or end. Its **start** is ``SLURM_JOB_START_TIME``
  (what Slurm, and sacct's ``Start``, say), else its first attempt's process start (a local run).
- **allocated time**: per allocation, from its start to its last attempt's last record; summed over the
  allocations of the run. The trainer cannot see past its own last record: the batch script's tail
  (``scontrol requeue``) and a killed attempt's last seconds before its next record are not in it (at
  most one heartbeat interval per attempt). Queue waits are not allocated time.
- **productive time**: the steps that advanced the run: iterations no earlier attempt had reached, except
  each attempt's first step (start-up: it compiles and warms up).
- **time lost**, by cause (they add up to allocated − productive):
  ``launch`` — an allocation's start to its first attempt's process start (prolog, batch script, srun,
  container, interpreter); ``start-up`` — an attempt's process start to the end of its first step, by
  phase (:data:`STARTUP_PHASES`); ``checkpoint`` — training blocked by saves (the host copy of an
  asynchronous save, waiting for the previous one, a synchronous write, the final save); ``evaluation``;
  ``recompute`` — steps of iterations an earlier attempt had already run (its failure threw them away:
  they were past its last checkpoint); ``restart`` — inside one allocation, from an attempt's last record
  to the next attempt's process start (failure detection, teardown, the retry's launch);
  ``other`` — the rest of each attempt (the shutdown, logging and anything not timed above).
- **waiting**: between one allocation's last record and the next one's start (a requeued job queued
  again); shown beside goodput, never in it.
- **goodput** = productive time / allocated time.
"""

from trainer.goodput.account import (  # noqa: F401 (the package's reading API)
    CAUSES,
    Goodput,
    account,
    format_lines,
    read_records,
    wandb_values,
)
from trainer.goodput.clock import STARTUP_PHASES, AttemptClock  # noqa: F401
