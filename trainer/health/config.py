"""The heartbeat, watchdog and preflight settings (torch-free): flat ``train.*`` keys of the config.

:class:`trainer.config.TrainConfig` inherits these fields, so they are defined once, here, beside the
monitor and the preflight that read them; ``TrainConfig.health()`` hands this slice to them.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config_issues import ConfigIssue, Section, issue


@dataclass
class HealthConfig(Section):
    """Heartbeats, the hang watchdog and the start-up preflight."""

    heartbeat_interval_s: float = 10.0
    """Seconds between heartbeat files (iteration, time, host, pid) that every rank writes to
    <run_dir>/heartbeats/; `python -m orchestrator status` marks ranks whose heartbeat is old as stale."""
    hang_timeout_s: float | None = 1800.0
    """Seconds without training progress (a step, evaluation batch or save) after which every waiting rank
    ends itself with exit code 70, so the retry policy resumes from the last checkpoint instead of a hung
    collective holding the allocation. One step, evaluation batch or checkpoint save must fit in it;
    start-up is not counted. 0 or null: off."""
    preflight: bool = True
    """At job start (multi-rank only): check in every rank, time data exchanges between every node pair
    and an all-reduce across all ranks; the figures go to <run_dir>/preflight.json."""
    preflight_timeout_s: float = 60.0
    """A rank or node pair not answering the preflight within this fails the job naming the node."""
    preflight_mb: float = 4.0
    """Megabytes moved in each timed preflight exchange."""
    preflight_slow_factor: float = 4.0
    """A node whose best link is this many times slower than the median node's fails the preflight
    (judged with three or more nodes)."""

    def problems(self) -> list[ConfigIssue]:
        out = []
        for name, low in (("heartbeat_interval_s", 0.0), ("preflight_timeout_s", 0.0), ("preflight_mb", 0.0),
                          ("preflight_slow_factor", 1.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= low:
                out.append(issue("positive", f"train.{name}", value, f"must be a number > {low:g}",
                                 f"set train.{name} above {low:g}"))
        hang = self.hang_timeout_s
        if hang is not None and (isinstance(hang, bool) or hang < 0):
            out.append(issue("positive", "train.hang_timeout_s", hang, "must be seconds >= 0",
                             "use seconds > 0, or 0/null to turn the watchdog off"))
        return out
