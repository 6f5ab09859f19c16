"""Read W&B's offline ``run-<id>.wandb`` files back (tests only).

wandb >= 0.2x writes them from its Go core and ships no Python reader, so this is the LevelDB-log framing
W&B documents for its transaction log: a 7-byte file header (":W&B", magic 0xBEE1, version 0), then
32 KiB blocks of records, each with a 7-byte header (crc32, length, type FULL/FIRST/MIDDLE/LAST);
a block's tail shorter than a header is zero padding. Each payload is a ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import glob
import json
import os
import struct

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(path: str):
    with open(path, "rb") as f:
        buf = f.read()
    ident, magic, version = struct.unpack("<4sHB", buf[:HEADER])
    assert ident == b":W&B" and magic == 0xBEE1 and version == 0, (ident, magic, version)
    pos, pending = HEADER, b""
    while pos < len(buf):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        if pos + HEADER > len(buf):
            break
        _crc, length, kind = struct.unpack("<IHB", buf[pos:pos + HEADER])
        data = buf[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:  # zero fill at the end of a flushed block
            continue
        if kind == FULL:
            yield data
        elif kind == FIRST:
            pending = data
        elif kind == MIDDLE:
            pending += data
        elif kind == LAST:
            yield pending + data
            pending = b""


def read_records(path: str):
    from wandb.proto import wandb_internal_pb2 as pb

    for data in _payloads(path):
        rec = pb.Record()
        rec.ParseFromString(data)
        yield rec


def history(path: str) -> list[dict]:
    """The logged rows, each a dict including ``_step``."""
    rows = []
    for rec in read_records(path):
        if rec.WhichOneof("record_type") == "history":
            row = {}
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            if rec.history.HasField("step"):
                row.setdefault("_step", rec.history.step.num)
            rows.append(row)
    return rows


def run_ids(path: str) -> set[str]:
    return {rec.run.run_id for rec in read_records(path) if rec.WhichOneof("record_type") == "run"}


def run_files(run_dir: str) -> list[str]:
    """All offline ``.wandb`` files under ``run_dir``, oldest first. W&B names a run's folder
    ``offline-run-<YYYYmmdd_HHMMSS>-<id>`` and appends ``-1``, ``-2`` ... when a second run of the same id
    starts within the same second, so a plain sort would put ``<id>-1/`` before ``<id>/`` ('-' < '/')."""
    return sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb")), key=_started)


def _started(path: str) -> tuple[str, int]:
    folder, name = os.path.basename(os.path.dirname(path)), os.path.basename(path)
    run_id = name[len("run-"):-len(".wandb")]
    stamp, _, rest = folder[len("offline-run-"):].partition("-")
    suffix = rest[len(run_id):].lstrip("-")
    return stamp, int(suffix) if suffix.isdigit() else 0
