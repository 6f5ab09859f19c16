"""Run identity and the run directory: ids, git state, file fingerprints, ``run.json`` and sweep manifests.

Layout: ``runs/<experiment>/<run_id>/`` with ``run.json`` (identity and the launch history:
launches.py), ``launches/<n>/`` (each launch's resolved ``config.yaml`` and submitted ``scripts/``),
``config.yaml`` (a link to the latest launch's), ``logs/``, ``jobs/`` (submitit pickles), ``stages/``
(markers), ``checkpoints/``, ``hf/``, ``wandb/``. Reads of the outside world (git, file stats) live here
so plan.py stays pure.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import secrets
import subprocess
from pathlib import Path
from typing import Any

from orchestrator.base.schema import SlipwayConfig
from orchestrator.world.content_hash import content_fingerprint
from trainer.run_files import RUN_JSON

REPO_ROOT = Path(__file__).resolve().parents[2]
SWEEP_JSON = "sweep.json"
CACHE_DIR = "_cache"  # the shared stages' outputs under runs_root when cache_dir is unset


def mint_run_id(now: _dt.datetime | None = None) -> str:
    now = now or _dt.datetime.now()
    return f"{now:%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


def default_run_dir(cfg: SlipwayConfig, run_id: str) -> str:
    return cfg.run_dir or os.path.join(cfg.runs_root, cfg.experiment, run_id)


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def git_state() -> dict[str, Any]:
    """sha, whether the tree is dirty, and the diff of tracked files (saved next to run.json)."""
    sha = (_git("rev-parse", "HEAD") or "").strip() or None
    status = _git("status", "--porcelain", "--untracked-files=no") or ""
    diff = _git("diff", "HEAD") or "" if status.strip() else ""
    return {"sha": sha, "dirty": bool(status.strip()), "diff": diff}


def code_version(paths: tuple[str, ...] = ("trainer", "trainer/data")) -> dict[str, str]:
    """Per package: the git tree hash at HEAD, plus a hash of uncommitted changes under it.

    Stage keys include this, so changing the preprocessing code invalidates cached preprocessed data and
    nothing else.
    """
    out = {}
    for p in paths:
        tree = (_git("rev-parse", f"HEAD:{p}") or "").strip()
        dirty = (_git("diff", "HEAD", "--", p) or "") + (
            _git("ls-files", "--others", "--exclude-standard", p) or ""
        )
        extra = hashlib.sha256(dirty.encode()).hexdigest()[:12] if dirty else ""
        out[p] = f"{tree[:16]}{'+' + extra if extra else ''}" or "unknown"
    return out


def fingerprint(path: str) -> str | None:
    """The content hash of an input file (memoised per file version: orchestrator/world/content_hash.py); a
    changed input gets a new preprocessing key, however its size and timestamps look."""
    return content_fingerprint(path)


def tokenizer_dir_fingerprint(model_dir: str | None) -> str | None:
    """The content hash of a HuggingFaceTokenizer directory's files (size and mtime would miss a tokenizer
    re-saved over the old one within a second, and would not survive a copy to another filesystem)."""
    from trainer.data.hf_tokenizer import content_hash

    try:
        return "sha256:" + content_hash(model_dir) if model_dir else None
    except (OSError, ValueError):
        return None  # missing: check_files and the input checks say so


def hf_vocab_entries(model_dir: str | None) -> int | None:
    """len(tokenizer) of a HuggingFaceTokenizer directory (Megatron's vocab_size for it), when loadable."""
    from trainer.data.hf_tokenizer import load_hf_tokenizer

    try:
        return load_hf_tokenizer(model_dir).vocab_size if model_dir else None
    except (OSError, ValueError):
        return None


def vocab_entries(path: str | None) -> int | None:
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return len(json.load(f))
    except (OSError, ValueError):
        return None


def write_text(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all (a reader never sees half a file): a temporary file beside it,
    then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no empty leftover
        raise


def write_json(path: Path, data: dict[str, Any]) -> None:
    write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def add_to_sweep(sweep_dir: str, entry: dict[str, Any], header: dict[str, Any]) -> None:
    """Sweep manifest: one entry per point (run dir, overrides, job ids)."""
    path = Path(sweep_dir) / SWEEP_JSON
    data = read_json(path) if path.exists() else dict(header, points=[])
    data["points"] = [p for p in data["points"] if p.get("point") != entry.get("point")] + [entry]
    write_json(path, data)


def run_dirs_of(path: str, below: bool = False) -> list[Path]:
    """The runs a command acts on (status, cancel, logs, list): a run dir → [it]; a sweep dir → its points'
    run dirs (in point order); with ``below``, any other folder (``runs_root``, an experiment's folder)
    → every run under it (:func:`runs_under`). Raises FileNotFoundError naming what it expected."""
    p = Path(path)
    if (p / SWEEP_JSON).exists():
        points = sorted(read_json(p / SWEEP_JSON)["points"], key=lambda e: e.get("point", 0))
        return [Path(e["run_dir"]).resolve() for e in points]
    if (p / RUN_JSON).exists():
        return [p.resolve()]
    if below and p.is_dir():
        return runs_under(p)
    what = "a folder of runs (runs_root), " if below else ""
    raise FileNotFoundError(
        f"{path}: neither {what}a run directory ({RUN_JSON}) nor a sweep directory ({SWEEP_JSON})"
    )


RUN_DEPTH = 3  # <runs_root>/<experiment>/<run_id>/run.json: a run is at most this deep below a root


def runs_under(root: str | Path) -> list[Path]:
    """Every run directory under ``root`` (``runs_root``, or one experiment's folder), oldest first: a
    folder holding ``run.json`` at most :data:`RUN_DEPTH` levels down. The shared cache holds no run and is
    not entered."""
    root = Path(root)
    found, todo = [], [(root, 0)]
    while todo:
        folder, depth = todo.pop()
        if (folder / RUN_JSON).is_file():
            found.append(folder.resolve())
            continue
        if depth >= RUN_DEPTH:
            continue
        try:
            children = [c for c in folder.iterdir() if c.is_dir() and c.name != CACHE_DIR]
        except OSError:
            continue
        todo += [(c, depth + 1) for c in children]
    return sorted(found, key=lambda r: (_mtime(r / RUN_JSON), str(r)))




def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
