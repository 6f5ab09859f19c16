"""Checkpoints that verify themselves: a manifest written last, checked at load and (sizes) at plan time.

Each writing rank hashes its shard after the fsync and leaves the digest beside it (``DIGEST_FILE``,
inside the shard folder that is renamed into place); after the barrier global rank 0 writes
``iter_N/manifest.json`` — every file's size and SHA-256, the layout and the iteration — atomically, and
only then commits the tracker. So a checkpoint with a manifest was complete when it was written, and any
later damage (a truncated copy, a bad disk, a stray edit) shows as a size or checksum mismatch.

:func:`problems` lists what is wrong with one iteration folder; :func:`quarantine` moves a damaged one
aside (renamed, never deleted: ``iter_N.damaged-<time>``, which no loader matches). Checkpoints without
a manifest (written by Megatron-LM or an older Slipway) are checked for completeness only: every shard
of the layout their folders show must be there and non-empty.

Torch-free: the orchestrator checks sizes at plan time (``full=False``) without importing torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field

from trainer.checkpoint import dist_read
from trainer.checkpoint.files import (
    DIST_COMMON,
    DIST_METADATA,
    SHARD_DIR_RE,
    SHARD_FILE,
    TRACKER,
    iter_path,
    list_iterations,
    parse_tracker,
    tracker_text,
)
from trainer.disk import sha256_file

MANIFEST = "manifest.json"
DIGEST_FILE = ".sha256"
MANIFEST_VERSION = 1
WARNINGS_FILE = "checkpoint_warnings.jsonl"  # in the run directory: read by status and the summary


def _digest_name(file_name: str) -> str:
    """The shard file's digest is ``DIGEST_FILE``; another file's beside it (the distributed optimizer's
    ``distrib_optim.pt``) is ``DIGEST_FILE.<name>``."""
    return DIGEST_FILE if file_name == SHARD_FILE else f"{DIGEST_FILE}.{file_name}"


def write_digest(shard_dir: str, file_name: str, known: tuple[int, str] | None = None) -> None:
    """The writing rank's half: ``{size} {sha256}`` of one file of its shard folder, beside it (fsynced).
    ``known``: (size, sha256) of the bytes the writer handed to the file as it wrote them (no second read
    of the file: :class:`HashingWriter`); else read back from the file."""
    path = os.path.join(shard_dir, file_name)
    size, digest = known if known is not None else (os.path.getsize(path), sha256_file(path))
    line = f"{size} {digest}\n"
    with open(os.path.join(shard_dir, _digest_name(file_name)), "w", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


class HashingWriter:
    """A binary file's ``write`` that also hashes and counts what goes through it (torch.save writes a
    file object sequentially, handing over each storage as one memoryview: hashlib hashes it without a
    copy and without the GIL), so a file's digest costs no second read of its bytes."""

    def __init__(self, f) -> None:
        self.f, self.size, self._sha = f, 0, hashlib.sha256()

    def write(self, data) -> int:
        self._sha.update(data)
        self.size += memoryview(data).nbytes
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()

    def digest(self) -> tuple[int, str]:
        return self.size, self._sha.hexdigest()


def _atomic_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_digest(folder: str, digest_name: str) -> dict:
    with open(os.path.join(folder, digest_name), encoding="utf-8") as f:
        size, digest = f.read().split()
    return {"size": int(size), "sha256": digest}


def write_manifest(iter_dir: str, iteration: int, tp_size: int, pp_size: int, file_name: str) -> None:
    """Rank 0's half, after the barrier: collect every shard's digest into the manifest (a torch_dist
    folder has no shard folders: the digests of its files lie beside them, at the top)."""
    files = {}
    for shard in sorted(n for n in os.listdir(iter_dir) if SHARD_DIR_RE.match(n)):
        beside = sorted(n.removeprefix(f"{DIGEST_FILE}.") for n in os.listdir(os.path.join(iter_dir, shard))
                        if n.startswith(f"{DIGEST_FILE}."))
        for name in [file_name, *beside]:
            files[f"{shard}/{name}"] = _read_digest(os.path.join(iter_dir, shard), _digest_name(name))
    for digest in sorted(n for n in os.listdir(iter_dir) if n.startswith(f"{DIGEST_FILE}.")):
        files[digest.removeprefix(f"{DIGEST_FILE}.")] = _read_digest(iter_dir, digest)
    _atomic_json(os.path.join(iter_dir, MANIFEST), {
        "version": MANIFEST_VERSION, "iteration": iteration, "tp_size": tp_size, "pp_size": pp_size,
        "files": files, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")})


def read_manifest(iter_dir: str) -> dict | None:
    """The manifest, None when the folder has none; raises ValueError when it is unreadable."""
    path = os.path.join(iter_dir, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            man = json.load(f)
        if not isinstance(man.get("files"), dict):
            raise ValueError("no 'files' table")
        return man
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is unreadable ({e})") from e


def _completeness(iter_dir: str, file_name: str) -> list[str]:
    """A checkpoint without a manifest: every (tp, pp) shard its folders imply, present and non-empty
    (Megatron-core's torch_dist: its metadata, common state and data files)."""
    if os.path.isfile(os.path.join(iter_dir, DIST_METADATA)):
        return _dist_completeness(iter_dir)
    ranks = [(int(m.group(1)), int(m.group(2) or 0))
             for n in os.listdir(iter_dir) if (m := SHARD_DIR_RE.match(n))]
    if not ranks:
        return [f"{iter_dir} holds no mp_rank_* shard folder"]
    tp, pp = max(t for t, _ in ranks) + 1, max(p for _, p in ranks) + 1
    out = []
    for t in range(tp):
        for p in range(pp):
            shard = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
            path = os.path.join(iter_dir, shard, file_name)
            if not os.path.isfile(path) or os.path.getsize(path) == 0:
                out.append(f"{path} is missing or empty")
    return out


def _dist_completeness(iter_dir: str) -> list[str]:
    names = os.listdir(iter_dir)
    out = []
    path = os.path.join(iter_dir, DIST_METADATA)
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return [f"{path} is missing or empty"]
    common = os.path.join(iter_dir, DIST_COMMON)
    if os.path.isfile(common) and os.path.getsize(common) == 0:
        out.append(f"{common} is empty")
    elif not dist_read.has_common(iter_dir):  # core 0.19 keeps it in the data files
        out.append(f"{common} is missing (and the metadata lists no {dist_read.COMMON_STATE!r} object)")
    data = [n for n in names if n.endswith(".distcp")]
    if not data or any(os.path.getsize(os.path.join(iter_dir, n)) == 0 for n in data):
        out.append(f"{iter_dir} has no (or an empty) .distcp data file: the torch_dist save is incomplete")
    return out


def problems(iter_dir: str, file_name: str, *, full: bool = True) -> list[str]:
    """What is wrong with one checkpoint folder: [] when it verifies. ``full``: checksums too (reads every
    file once); else sizes only (cheap: for plan time)."""
    if not os.path.isdir(iter_dir):
        return [f"{iter_dir} does not exist"]
    try:
        man = read_manifest(iter_dir)
    except ValueError as e:
        return [str(e)]
    if man is None:
        return _completeness(iter_dir, file_name)
    out = []
    for rel, want in sorted(man["files"].items()):
        path = os.path.join(iter_dir, rel)
        if not os.path.isfile(path):
            out.append(f"{path} is missing")
            continue
        size = os.path.getsize(path)
        if size != want["size"]:
            out.append(f"{path} has {size} bytes, the manifest says {want['size']} (truncated or replaced)")
        elif full and sha256_file(path) != want["sha256"]:
            out.append(f"{path} does not match its SHA-256 in the manifest (the file is damaged)")
    return out


def never_committed(iter_dir: str) -> bool:
    """A folder a save was still writing when it was stopped: no manifest (written just before the
    tracker, the commit point) and a shard still in its temporary folder (trainer.checkpoint.protocol,
    step 1). Loaders ignore such a folder, and the next save of the iteration replaces it."""
    try:
        names = os.listdir(iter_dir)
    except OSError:
        return False
    return MANIFEST not in names and any(n.startswith(".tmp-") for n in names)


def quarantine(iter_dir: str) -> str:
    """Move a damaged checkpoint aside (``iter_N.damaged-<time>``): kept for inspection, never loaded,
    never pruned by ``checkpoint.keep``. Returns the new path."""
    dest = f"{iter_dir}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
    n = 1
    while os.path.exists(dest):
        dest, n = f"{iter_dir}.damaged-{time.strftime('%Y%m%d-%H%M%S')}-{n}", n + 1
    os.rename(iter_dir, dest)
    return dest


@dataclass
class Choice:
    """What :func:`choose_latest` decided: the iteration to load (None: there is no checkpoint at all),
    the damaged ones (with what is wrong and where they were moved), and warnings for the log."""

    iteration: int | None
    tracker_iteration: int | None
    damaged: dict[int, list[str]] = field(default_factory=dict)
    moved: dict[int, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


class NoVerifiedCheckpoint(RuntimeError):
    """Checkpoints exist but none verifies: starting over would overwrite them, so nothing starts."""


def choose_latest(ckpt_dir: str, *, full: bool = True, act: bool = True) -> Choice:
    """The newest checkpoint that verifies. The tracker is a hint, not the only truth: when it is
    missing or unreadable but ``iter_*`` folders exist, the newest complete one is chosen (never "start
    over"); a damaged one is skipped and, with ``act``, moved aside. Folders newer than a valid tracker
    are left alone (a run rewound with ``checkpoint.load: N`` may have them)."""
    text = tracker_text(ckpt_dir)
    tracked = parse_tracker(text)
    found = list_iterations(ckpt_dir)
    choice = Choice(None, tracked)
    if tracked is not None:
        candidates = [tracked] + [i for i in reversed(found) if i < tracked]
    else:
        # A save killed before its commit left a folder without manifest, its shards still temporary (the
        # first save of a run, or any with the tracker lost): not a checkpoint, whatever else is there.
        unfinished = [i for i in found if never_committed(iter_path(ckpt_dir, i))]
        choice.warnings += [f"{iter_path(ckpt_dir, i)} is a save that never completed (no manifest, a shard "
                            "still in its temporary folder): not a checkpoint; the next save of that "
                            "iteration replaces it" for i in unfinished]
        found = [i for i in found if i not in unfinished]
        candidates = list(reversed(found))
        if found:
            why = "is missing" if text is None else f"holds {text!r}, not an iteration number"
            choice.warnings.append(f"{ckpt_dir}/{TRACKER} {why}, but the folder holds checkpoints of "
                                   f"iterations {found[-5:]}: loading the newest one that verifies")
    for it in candidates:
        path = iter_path(ckpt_dir, it)
        wrong = problems(path, SHARD_FILE, full=full)
        if not wrong:
            choice.iteration = it
            break
        choice.damaged[it] = wrong
        if act and os.path.isdir(path):
            choice.moved[it] = quarantine(path)
        where = f"; moved aside to {choice.moved[it]}" if it in choice.moved else ""
        choice.warnings.append(f"checkpoint iteration {it} in {ckpt_dir} failed verification: "
                               f"{'; '.join(wrong)}{where}")
    if choice.iteration is None and choice.damaged:
        raise NoVerifiedCheckpoint(
            f"no checkpoint in {ckpt_dir} verifies: " + " | ".join(choice.warnings) + ". Nothing was "
            "started, so nothing is overwritten: restore a good copy, or start a new run (another run_id "
            "or checkpoint.dir)")
    return choice


def record_warnings(run_dir: str, warnings: list[str]) -> None:
    """Append what was skipped at load to ``<run_dir>/checkpoint_warnings.jsonl``."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, WARNINGS_FILE), "a", encoding="utf-8") as f:
        for w in warnings:
            f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "warning": w}) + "\n")


def read_warnings(run_dir: str) -> list[str]:
    path = os.path.join(run_dir, WARNINGS_FILE)
    if not os.path.exists(path):
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line)["warning"])
            except (ValueError, KeyError):
                continue  # a line cut by a kill
    return out
