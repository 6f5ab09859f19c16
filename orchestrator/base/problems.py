"""The record of a configuration problem and the refusal that lists them all.

Checks (orchestrator/checks/) return :class:`Problem` records naming the key, the value and the fix; the
launch raises :class:`PlanError` with every one of them, so the user fixes a config in one round, not one
error per queue wait. The writer lock (orchestrator/record/writer_lock.py) refuses with that record, which is
why this module stands apart from the checks package (the lock's module is imported by one of the checks).
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.base.redaction import redact
from trainer.config_issues import ConfigIssue


@dataclass(frozen=True)
class Problem(ConfigIssue):
    """One configuration error (the trainer's :class:`ConfigIssue` record): ``code`` is its class (stable,
    used by tests), the rest is for people."""

    def __str__(self) -> str:
        # Secrets in the config are reported as "<redacted>" (checks/secrets.py); redact() also hides any
        # other value that looks like one (a token pasted into a path), so a refusal never prints a secret.
        return redact(super().__str__())


class PlanError(ValueError):
    """Raised instead of submitting when any problem was found; lists all of them."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        lines = "\n  - ".join(str(p) for p in problems)
        super().__init__(f"{len(problems)} configuration problem(s); nothing was submitted:\n  - {lines}")
