"""Input files identified by their bytes: the preprocessing cache key's fingerprint of each input.

A size + mtime fingerprint reuses stale data after a same-size edit whose timestamp was restored (``cp -p``,
``rsync -t``, ``touch -r``, a tool that preserves mtimes). So the fingerprint is the sha256 of the bytes,
computed once per file version and memoised by (device, inode, size, mtime_ns, ctime_ns): a relaunch over
unchanged inputs costs one ``stat`` per file. ctime is in the memo key because no user can set it: any write,
and restoring the mtime itself, moves it, so an edit is always hashed again.

The memo lives in ``$XDG_CACHE_HOME/slipway/content_hashes.json`` (default ``~/.cache``), one per user;
losing it only costs a rehash. Login nodes only (the orchestrator); torch-free.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from trainer.disk import sha256_file
from trainer.log import get_logger

log = get_logger(__name__)

MEMO_FILE = "content_hashes.json"
_LOG_ABOVE = 1 << 30  # bytes: say what takes the time when hashing a large file


def memo_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "slipway" / MEMO_FILE


def _version(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _read_memo(path: Path) -> dict[str, dict[str, str]]:
    try:
        memo = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) else {}


def _write_memo(path: Path, memo: dict) -> None:
    """Atomic replace; a concurrent launch may win the race, which costs at most a rehash later."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(memo), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not save the input hashes to %s (%s); the next launch hashes them again", path, e)


def content_fingerprint(path: str, memo_file: Path | None = None) -> str | None:
    """``sha256:<hex>`` of ``path``'s bytes (None when it cannot be read: the input checks say why)."""
    memo_file = memo_file or memo_path()
    try:
        st = os.stat(path)
    except OSError:
        return None
    key, version = os.path.abspath(path), _version(st)
    memo = _read_memo(memo_file)
    entry = memo.get(key)
    if isinstance(entry, dict) and entry.get("version") == version:
        return entry["sha256"]
    start = time.monotonic()
    if st.st_size > _LOG_ABOVE:
        log.info("hashing %s (%.1f GB) for the preprocessing cache key; memoised in %s", path,
                 st.st_size / 1e9, memo_file)
    try:
        digest = "sha256:" + sha256_file(path)
    except OSError:
        return None
    if st.st_size > _LOG_ABOVE:
        log.info("hashed %s in %.1f s", path, time.monotonic() - start)
    if _version(os.stat(path)) != version:
        return digest  # written to while hashed: do not memoise a version that no longer exists
    memo = _read_memo(memo_file)  # re-read: another launch may have added entries meanwhile
    memo[key] = {"version": version, "sha256": digest}
    _write_memo(memo_file, memo)
    return digest
