"""The submitting user's Slurm associations — the accounts they may charge, each with its partition (empty:
all of them) and the QoS it allows — as ``sacctmgr`` reports them where accounting runs (slurmdbd), so the
plan can refuse a misspelled ``cluster.account`` or ``cluster.qos`` before sbatch does (or, where the site
does not enforce associations, before the jobs are charged to nothing). Slurm keeps these names in lower
case (sacctmgr(1)), so they are compared so.
"""

from __future__ import annotations

import os
import pwd
import subprocess
from dataclasses import dataclass

# One line per association of the user: account|partition|qos1,qos2 (sacctmgr -n -P).
ASSOC_FORMAT = "account,partition,qos"


@dataclass(frozen=True)
class Association:
    account: str
    partition: str  # "" : every partition
    qos: tuple[str, ...]


def parse(text: str) -> list[Association]:
    """``sacctmgr -n -P show associations ... format=ASSOC_FORMAT`` output → the associations."""
    out = []
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) < 3 or not fields[0]:
            continue
        account, partition, qos = fields[:3]
        out.append(Association(account.lower(), partition.lower(),
                               tuple(q.lower() for q in qos.split(",") if q)))
    return out


def user_name() -> str:
    """Who sbatch submits as: the uid's login name (not $USER, which a job or sudo may have changed)."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def _run(argv: list[str], timeout_s: float) -> tuple[str, str]:
    """(stdout, why it failed: "" when it did not)."""
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        return "", f"{argv[0]} is not on this node's PATH"
    except subprocess.TimeoutExpired:
        return "", f"{argv[0]} did not answer within {timeout_s:.0f} s"
    if res.returncode != 0:
        first = next((ln for ln in res.stderr.splitlines() if ln.strip()), f"exit status {res.returncode}")
        return "", first.strip()
    return res.stdout, ""


def cluster_name(timeout_s: float = 20.0) -> str | None:
    """This Slurm's ClusterName (scontrol show config): one accounting database may serve several."""
    out, _ = _run(["scontrol", "show", "config"], timeout_s)
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "ClusterName":
            return value.strip() or None
    return None


def associations(user: str, timeout_s: float = 20.0) -> list[Association] | str:
    """The user's associations on this cluster, or why Slurm cannot say (no sacctmgr here, accounting
    not running: ``AccountingStorageType=accounting_storage/none`` or slurmdbd unreachable)."""
    where = [f"user={user}"]
    cluster = cluster_name(timeout_s)
    if cluster:
        where.append(f"cluster={cluster}")
    out, why = _run(["sacctmgr", "-n", "-P", "show", "associations", "where", *where,
                     f"format={ASSOC_FORMAT}"], timeout_s)
    return why if why else parse(out)
