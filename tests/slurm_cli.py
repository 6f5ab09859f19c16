"""The one way tests ask Slurm a question: a command that fails raises, naming the command and its stderr.

A helper that swallowed a non-zero exit would turn "Slurm is unreachable" into "no job was submitted" or
"the job has no state yet", and a test asserting those would pass without checking anything.
"""

from __future__ import annotations

import subprocess

from orchestrator.world.queue import ENDED
from tests.waits import NEVER_S, wait_until

TERMINAL = ENDED  # the states in which a job has ended: orchestrator.world.queue's vocabulary, not a copy


class SlurmCommandError(AssertionError):
    """A Slurm client command exited non-zero (the cluster is down, SLURM_CONF is wrong, a bad job id)."""


def slurm(*args: str, timeout: float = 60, env: dict | None = None) -> str:
    """Run a Slurm client command (``squeue``, ``sacct``, ``scontrol`` ...) and return its stdout."""
    try:
        out = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=env)
    except FileNotFoundError as exc:
        raise SlurmCommandError(f"{args[0]} not found: is slurm-wlm installed? ({exc})") from exc
    if out.returncode != 0:
        raise SlurmCommandError(f"`{' '.join(args)}` exited {out.returncode}: {out.stderr.strip()[-2000:]}")
    return out.stdout


def sacct_states(job_id: str, *, duplicates: bool = False) -> list[str]:
    """Accounting states of the job's allocation records (with ``duplicates``: every requeue's too)."""
    args = ["sacct", "-j", str(job_id), "-X", "-n", "-P", "-o", "State"] + (["-D"] if duplicates else [])
    return [line.split(" ")[0] for line in slurm(*args).split()]


def sacct_final_state(job_id: str, timeout: float = NEVER_S) -> str:
    """The job's final accounting state; slurmctld reports to slurmdbd asynchronously, so poll (a message
    naming the last state seen, not a state, if none came within ``timeout``)."""
    seen = [""]

    def terminal() -> str | None:
        states = sacct_states(job_id)
        seen[0] = states[0] if states else ""
        return seen[0] if seen[0] in TERMINAL else None

    try:
        return wait_until(terminal, f"job {job_id} to end", timeout, poll_s=0.5)
    except AssertionError:
        return f"no terminal state after {timeout} s (last: {seen[0]!r})"
