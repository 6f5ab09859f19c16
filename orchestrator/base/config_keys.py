"""Keys a composed config has that the schema does not, and the did-you-mean of each (torch-free).

One definition for both ways a key reaches Slipway: ``+optim.lrr=3e-4`` (Hydra adds the key; typing would
drop it: :func:`unknown_keys`, from orchestrator/base/schema.py ``to_typed``) and ``optim.lrr=3e-4`` (Hydra
refuses it itself; orchestrator/launch/hydra_errors.py turns its error into :func:`unknown_key`). A Slurm
time written where a minute count goes (``cluster.time=48:00:00``) gets the minutes (:func:`slurm_minutes`).
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from trainer.config_issues import ConfigIssue, issue


def slurm_minutes(text: str) -> int | None:
    """Slurm's time formats (sbatch --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
    days-hours:minutes, days-hours:minutes:seconds) in whole minutes, rounded up; None for anything else."""
    days, _, rest = str(text).strip().rpartition("-")
    parts = rest.split(":")
    if not all(p.isdigit() for p in parts) or len(parts) > 3 or (days and not days.isdigit()):
        return None
    nums = [int(p) for p in parts]
    if days:  # days-hours[:minutes[:seconds]]
        hours, minutes, seconds = (nums + [0, 0])[:3]
        hours += 24 * int(days)
    else:  # minutes | minutes:seconds | hours:minutes:seconds
        hours, minutes, seconds = [0, *nums, 0][:3] if len(nums) < 3 else nums
        if len(nums) == 1:
            hours, minutes, seconds = 0, nums[0], 0
    return hours * 60 + minutes + (1 if seconds else 0)


def suggest(kind: type, key: str, value: Any, path: str) -> str:
    """"did you mean <path>.<field>=<value>? " for an unknown ``key`` of section ``kind`` (a close spelling,
    or a field that begins with it: cluster.time → cluster.time_limit_min), with a Slurm time turned into
    the minutes a ``*_min`` field takes; "" when nothing is close."""
    names = [f.name for f in dataclasses.fields(kind)]
    close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
    close = close or [n for n in names if n.startswith(f"{key}_")][:1]
    if not close:
        return ""
    target = f"{path}.{close[0]}" if path else close[0]
    minutes = slurm_minutes(value) if close[0].endswith("_min") and value is not None else None
    if minutes is None or str(minutes) == str(value):
        return f"did you mean {target}={value}? "
    return f"did you mean {target}={minutes} ({value} in minutes)? "


def unknown_key(kind: type, full: str, value: Any) -> ConfigIssue:
    """The problem of a key ``full`` (dotted) that section ``kind`` does not have, with a did-you-mean."""
    path, _, key = full.rpartition(".")
    names = [f.name for f in dataclasses.fields(kind)]
    listed = f": {', '.join(names)}" if len(names) <= 12 else ""
    where = f"section {path}" if path else "the top level"
    return issue("unknown_key", full, value,
                 f"is no key of {where} ({kind.__name__}{listed}); a leading + adds keys only to mappings "
                 "such as cluster.env or cluster.sbatch_extra",
                 suggest(kind, key, value, path) + "docs/config.md lists every key")


def unknown_keys(node: Any, path: str = "") -> list[ConfigIssue]:
    """Keys of a composed config that no section of the schema has. Hydra refuses ``optim.lrr=3e-4``
    itself (orchestrator/launch/hydra_errors.py says it as this problem), but its own hint
    (``+optim.lrr=3e-4``) adds the key to the typed section and typing then drops it without a word;
    mappings (cluster.env, cluster.sbatch_extra, ...) take any key."""
    from omegaconf import DictConfig, OmegaConf

    kind = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(kind):
        return []
    names = [f.name for f in dataclasses.fields(kind)]
    out = []
    for key in node.keys():
        full = f"{path}.{key}" if path else str(key)
        if key not in names:
            out.append(unknown_key(kind, full, OmegaConf.select(node, str(key), default=None)))
            continue
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            out += unknown_keys(child, full)
    return out
