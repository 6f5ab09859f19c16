"""Full disks, recognised and described (torch-free: preprocessing and the checkpoint protocol share it).

A full disk shows up three ways: an OSError with ENOSPC/EDQUOT (``write``, ``fsync``), the same wrapped in
another exception (``torch.save`` raises a RuntimeError), or numpy's short write (``tofile`` raises
``OSError: N requested and M written`` with no errno at all).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil

_SHORT_WRITE = re.compile(r"(\d+) requested and (\d+) written")


def out_of_space(err: BaseException | None) -> bool:
    """Whether ``err`` (or an exception it wraps) is ENOSPC/EDQUOT or numpy's short write."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, OSError) and (err.errno in (errno.ENOSPC, errno.EDQUOT) or short_write(err)):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def short_write(err: BaseException) -> int | None:
    """Bytes a numpy ``tofile`` could not write (``N requested and M written``), else None."""
    m = _SHORT_WRITE.search(str(err))
    return int(m.group(1)) - int(m.group(2)) if m else None


def free_bytes(path: str) -> int:
    """Free bytes (for this user) on the filesystem that holds ``path`` or its nearest existing parent."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def folder_bytes(path: str) -> int:
    """Bytes of every file under ``path`` (a checkpoint folder); 0 when it does not exist."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                continue
    return total


def size(n: int) -> str:
    """Bytes, exactly, with MiB for reading."""
    return f"{n} bytes ({n / 2**20:.1f} MiB)"


def as_open_would(path: str) -> None:
    """Give a ``tempfile.mkstemp`` file the mode ``open()`` would have (0666 less the umask): mkstemp's
    0600 would make a published file private, unreadable to the group that shares a cache."""
    umask = os.umask(0)  # the only portable way to read it; restored at once
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def sha256_file(path: str) -> str:
    """The hex SHA-256 of a file's bytes, read in 8 MiB chunks (checkpoint manifests, input fingerprints)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


RESERVE_BYTES = 8192  # room for a failure record (the stage markers truncate their text to fit)


def reserve(path: str, nbytes: int = RESERVE_BYTES) -> bool:
    """Allocate ``path`` now (``nbytes`` of spaces, fsynced) so that a record can still be written through
    it when the disk has filled up (:func:`write_reserved`). False when even this fails: the disk is full
    already, and what fails next says so in its own error."""
    try:
        with open(path, "wb") as f:
            f.write(b" " * nbytes)
            f.flush()
            os.fsync(f.fileno())
        return True
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path)
        return False


def write_reserved(path: str, reserved: str, text: str) -> None:
    """``text`` as ``path`` through the file :func:`reserve` allocated: overwritten in place (blocks
    already allocated: no new space where files are overwritten in place, as on ext4, xfs and tmpfs; a
    copy-on-write filesystem may still refuse), padded with spaces to its size (JSON allows trailing
    blanks), then renamed to ``path``."""
    data = text.encode()
    size = os.path.getsize(reserved)
    if len(data) > size:
        raise ValueError(f"{len(data)} bytes do not fit the {size} reserved in {reserved}")
    with open(reserved, "r+b") as f:
        f.write(data + b" " * (size - len(data)))
        f.flush()
        os.fsync(f.fileno())
    os.replace(reserved, path)
