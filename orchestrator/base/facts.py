"""The facts a plan is made from that the pure planner cannot gather itself (runs.py and flow.py do):
the run's identity, code versions, input fingerprints, the launching environment, the sweep point."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SweepInfo:
    sweep_id: str
    sweep_dir: str
    point: int
    overrides: tuple[str, ...]  # the point's own overrides (what varies), e.g. ("optim.lr=1e-4",)


@dataclass(frozen=True)
class PlanInputs:
    """Facts gathered outside the pure planner (see runs.py): identity, code versions, file fingerprints."""

    run_id: str
    run_dir: str
    code_version: dict[str, str] = field(default_factory=dict)  # package path -> tree hash
    fingerprints: dict[str, str] = field(default_factory=dict)  # input path -> content hash (runs.py)
    vocab_from_file: int | None = None  # entries in tokenizer.vocab_file when readable here
    sweep: SweepInfo | None = None
    environ: dict[str, str] = field(default_factory=dict)  # the launching environment (secrets, test hooks)
