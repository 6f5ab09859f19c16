"""The training data: where it comes from (input files or the corpus stage), that the input files exist
and hold documents, and that every split the run draws from gets documents; and that preprocessed data
the launch would reuse from the cache is intact.

The document scan reads each file up to ``SCAN_BYTES``: a directory, an empty file or a JSONL with no
non-empty document is refused, and when the files are small enough to scan whole, so is a document count
that leaves a split without documents (the trainer's own rule, :mod:`trainer.data.splits`) — one 30 MB
document, say; a weighted blend's corpora are checked one by one (each is split on its own). A cached
output is opened and validated as the trainer would (``.idx`` header and offsets, ``.bin`` length), so a
truncated file is refused here, naming the file, instead of failing a job on the cluster.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

from orchestrator.base.plan_types import Context
from orchestrator.base.problems import Problem
from orchestrator.stages.preprocess import NAME as PREPROCESS
from trainer.data.blend import BlendError
from trainer.run_files import COMPLETE

SCAN_BYTES = 32 << 20  # per file; larger inputs are checked only for a first non-empty document


def missing_files(ctx: Context, files: list[tuple[str, str]]) -> list[Problem]:
    """``file_missing`` for each (key, path) that does not exist now: the inputs a stage reads that no
    earlier stage produces (data, tokenizer and image files all use it)."""
    return [Problem("file_missing", key, path, "file does not exist (as seen from this node)",
                    f"create it or point {key} at an existing file (paths must be on shared storage)")
            for key, path in files if not ctx.exists(path)]


def data_source_problems(ctx: Context) -> list[Problem]:
    d, out = ctx.cfg.data, []
    if d.corpus is None and not d.paths:
        out.append(
            Problem(
                "data_missing",
                "data.paths",
                [],
                "no input files and no corpus stage",
                "set data.paths=[/path/train.jsonl] or data=stdlib",
            )
        )
    if d.corpus is not None and d.paths:
        out.append(Problem("data_paths_ignored", "data.paths", list(d.paths),
                           "the corpus stage (data.corpus) builds this run's input, so these files would "
                           "be ignored", "to train on them set data.corpus=null (and tokenizer.vocab_file/"
                           "merge_file, or tokenizer.vocab_size to train one); otherwise drop data.paths"))
    return out


def data_file_problems(ctx: Context) -> list[Problem]:
    d = ctx.cfg.data
    return [] if d.corpus is not None else missing_files(ctx, [("data.paths", p) for p in d.inputs()])


def _documents(path: str, key: str) -> tuple[int, bool]:
    """(non-empty documents seen, whether the whole file was read) within SCAN_BYTES of text."""
    opener = gzip.open if path.endswith(".gz") else open
    docs, read = 0, 0
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        for line in f:
            read += len(line)
            try:
                value = json.loads(line).get(key) if line.strip() else None
            except (ValueError, AttributeError):
                value = None  # a bad line is data.on_error's business, not this check's
            docs += isinstance(value, str) and value != ""
            if read >= SCAN_BYTES:
                return docs, f.readline() == ""
    return docs, True


def data_problems(ctx: Context) -> list[Problem]:
    """The input files' documents (see the module docstring)."""
    cfg = ctx.cfg
    if cfg.data.corpus is not None:
        return []
    out, counts = [], {}
    for path in cfg.data.inputs():
        if os.path.isdir(path):
            out.append(Problem("data_is_dir", "data.paths", path, "is a directory, not a JSONL file",
                               f"list its files: data.paths=[{path.rstrip('/')}/part1.jsonl,...]"))
            continue
        if not os.path.isfile(path):
            continue  # file_missing says so
        docs, complete = _documents(path, cfg.data.json_key)
        counts[path] = docs if complete else None
        if docs == 0 and complete:
            empty = os.path.getsize(path) == 0
            out.append(Problem(
                "data_empty", "data.paths", path,
                "the file is empty" if empty else f"no line has a non-empty {cfg.data.json_key!r} field",
                "point data.paths at the training text, or set data.json_key to the field that holds it"))
    if out or None in counts.values() or not counts:
        return out
    try:
        weighted = cfg.data.blend().weights is not None
    except BlendError:
        return out  # the blend's own problem is reported by the config checks
    # A blend splits each corpus on its own documents (Megatron's rule); several plain paths are one dataset.
    corpora = counts.items() if weighted else [("data.paths", sum(counts.values()))]
    return out + [p for name, total in corpora for p in _split_problems(ctx, name, total)]


def _split_problems(ctx: Context, name: str, total: int) -> list[Problem]:
    from trainer.data.splits import samples_drawn, split_ranges

    t, split_spec, out = ctx.cfg.train, ctx.cfg.data.split, []
    ranges = split_ranges(split_spec, total)
    gbs = t.global_batch_size or t.micro_batch_size
    for split, wanted in samples_drawn(t.iters, gbs, t.eval_interval, t.eval_iters).items():
        docs = ranges[split]
        if wanted and (docs is None or docs[0] >= docs[1]):
            out.append(Problem(
                "data_split", "data.split", split_spec,
                f"the {split} split needs {wanted} samples but gets no document of the {total} in {name}",
                f"add documents, or give {split} a larger weight (each split needs at least one document)"))
    return out


def reused_data_problems(ctx: Context) -> list[Problem]:
    """Problems with a preprocessing output the launch would reuse (none when it will be built)."""
    prep = ctx.require_plan().stage(PREPROCESS)
    if not (Path(prep.state_dir) / COMPLETE).exists():
        return []
    from trainer.data.indexed_dataset import IndexedDataset, IndexedDatasetError

    out = []
    for prefix in [c.output_prefix_for(key) for c in prep.job for key in c.json_keys]:
        try:
            IndexedDataset(prefix).close()
        except IndexedDatasetError as err:
            out.append(Problem(
                "data_corrupt", "cache_dir", prep.state_dir,
                f"the cached preprocessed data this run would train on is unusable: {err}",
                f"delete the cache entry (rm -r {prep.state_dir}) and launch again; the preprocess stage "
                "rebuilds it from the inputs"))
    return out
