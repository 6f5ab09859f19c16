"""The record of a configuration problem and the refusal that lists them all.

Checks (orchestrator/checks/) return :class:`Problem` records naming the key, the value and the fix; the
launch raises :class:`PlanError` with every one of them, so the user fixes a config in one round, not one
error per queue wait. The writer lock (orchestrator/record/writer_lock.py) refuses with that record, which is
why this module stands apart from the checks package (the lock's module is imported by one of the checks).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from orchestrator.base.redaction import redact
from trainer.config_issues import ConfigIssue


@dataclass(frozen=True)
class Problem(ConfigIssue):
    """One configuration error (the trainer's :class:`ConfigIssue` record): ``code`` is its class (stable,
    used by tests), the rest is for people. ``follows``: the problem it follows from (:func:`arrange`)."""

    follows: str = ""

    def __str__(self) -> str:
        # Secrets in the config are reported as "<redacted>" (checks/secrets.py); redact() also hides any
        # other value that looks like one (a token pasted into a path), so a refusal never prints a secret.
        after = f" (follows from {self.follows} above: fix that first)" if self.follows else ""
        return redact(super().__str__() + after)


@dataclass(frozen=True)
class Cascade:
    """A problem that another one causes: ``follower`` (a code) while a ``root`` problem (a code, and its
    key unless None) stands. ``judged``: whether the follower's own rule can still be judged then (it is
    listed after its root and marked) or cannot (it is left out: its fix would be wrong)."""

    root: str
    root_key: str | None
    follower: str
    judged: bool


# What the layout is derived from: a node count the site cannot give (max_nodes, or cluster.gpus that is no
# whole number of nodes) makes every figure of the layout another run's — the world's split, the batch's
# micro-batches, the interleaved schedule's groups, the time limit's first checkpoint, the search, the
# partition's node count — each still worth a look once the count is right. A learning rate that is no
# learning rate leaves min_lr's range [0, lr] empty: "set min_lr <= lr" would be wrong advice. While
# another job of the run is active its checkpoints are being written: one mid-save does not verify yet, and
# "restore a good copy" would be wrong advice (the refusal is the active run; seen in test_fault_matrix's
# double launch when the second launch planned during the first job's save).
_LAYOUT_FOLLOWERS = ("world", "batch", "vpp_microbatches", "time_limit", "auto_layout", "auto_batch",
                     "partition_nodes")
CASCADES: tuple[Cascade, ...] = (
    *(Cascade(root, None, f, True) for root in ("max_nodes", "gpus") for f in _LAYOUT_FOLLOWERS),
    Cascade("positive", "optim.lr", "lr_range", False),
    Cascade("run_active", None, "checkpoint_damaged", False),
)


def _cause(i: int, problems: list[Problem]) -> tuple[int, Cascade] | None:
    """The index of the problem that problem ``i`` follows from, and the rule, if any."""
    p = problems[i]
    for c in CASCADES:
        if p.code == c.follower:
            root = next((j for j, q in enumerate(problems) if j != i and q.code == c.root
                         and c.root_key in (None, q.key)), None)
            if root is not None:
                return root, c
    return None


def arrange(problems: list[Problem]) -> list[Problem]:
    """``problems`` with each root cause before what follows from it (:data:`CASCADES`): a follower right
    after its root, marked, or left out where its rule cannot be judged; the rest in their order.
    Idempotent (the plan arranges its own problems, the launch again with the launch-time ones)."""
    tops: list[int] = []
    after: dict[int, list[int]] = {}
    marks: dict[int, str] = {}
    for i in range(len(problems)):
        found = _cause(i, problems)
        if found is None:
            tops.append(i)
        elif found[1].judged:
            root = problems[found[0]]
            after.setdefault(found[0], []).append(i)
            marks[i] = f"[{root.code}] {root.key}"
    out: list[Problem] = []

    def emit(i: int) -> None:
        out.append(dataclasses.replace(problems[i], follows=marks[i]) if i in marks else problems[i])
        for j in after.get(i, []):
            emit(j)

    for i in tops:
        emit(i)
    return out


class PlanError(ValueError):
    """Raised instead of submitting when any problem was found; lists all of them."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        lines = "\n  - ".join(str(p) for p in problems)
        super().__init__(f"{len(problems)} configuration problem(s); nothing was submitted:\n  - {lines}")
