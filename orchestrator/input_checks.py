"""Plan-time checks of the user's inputs that read them (cheaply), so a bad input fails the launch with the
key and the fix instead of a Slurm job after its retries:

- ``data.paths``: a directory, an empty file, or a JSONL with no non-empty document; and, when the files
  are small enough to scan whole (``SCAN_BYTES``), a document count that leaves a split the run draws from
  without documents (the trainer's own rule, :mod:`trainer.data.splits`) — one 30 MB document, say; a
  weighted blend's corpora are checked one by one (each is split on its own).
- ``tokenizer.vocab_file`` / ``merge_file``: loaded the way the jobs load them; a merges file of another
  tokenizer is named with both files.
- ``container.image`` with pyxis: a file must be squashfs (an Apptainer .sif is not; enroot cannot start it).
"""

from __future__ import annotations

import gzip
import json
import os

from orchestrator.container import SQUASHFS_MAGIC, image_is_file
from orchestrator.schema import SlipwayConfig
from orchestrator.validate import Problem
from trainer.data.blend import BlendError
from trainer.data.hf_tokenizer import HF_TOKENIZER_TYPE

SCAN_BYTES = 32 << 20  # per file; larger inputs are checked only for a first non-empty document


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


def data_problems(cfg: SlipwayConfig) -> list[Problem]:
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
    return out + [p for name, total in corpora for p in _split_problems(cfg, name, total)]


def _split_problems(cfg: SlipwayConfig, name: str, total: int) -> list[Problem]:
    from trainer.data.splits import samples_drawn, split_ranges

    t, out = cfg.train, []
    ranges = split_ranges(cfg.data.split, total)
    gbs = t.global_batch_size or t.micro_batch_size
    for split, wanted in samples_drawn(t.iters, gbs, t.eval_interval, t.eval_iters).items():
        docs = ranges[split]
        if wanted and (docs is None or docs[0] >= docs[1]):
            out.append(Problem(
                "data_split", "data.split", cfg.data.split,
                f"the {split} split needs {wanted} samples but gets no document of the {total} in {name}",
                f"add documents, or give {split} a larger weight (each split needs at least one document)"))
    return out


def tokenizer_problems(cfg: SlipwayConfig) -> list[Problem]:
    tok = cfg.tokenizer
    if tok.type == HF_TOKENIZER_TYPE:
        return hf_tokenizer_problems(tok.model)
    if not (tok.vocab_file and tok.merge_file and os.path.isfile(tok.vocab_file)
            and os.path.isfile(tok.merge_file)):
        return []  # file_missing / tokenizer_pair say so
    from trainer.data.tokenizer import TokenizerFileError, check_pair, read_merges, read_vocab

    try:
        check_pair(read_vocab(tok.vocab_file), read_merges(tok.merge_file), tok.vocab_file, tok.merge_file)
    except TokenizerFileError as err:
        return [Problem("tokenizer_invalid", "tokenizer.merge_file", tok.merge_file, str(err),
                        "set tokenizer.vocab_file and tokenizer.merge_file to the files of one tokenizer")]
    return []


def hf_tokenizer_problems(model_dir: str | None) -> list[Problem]:
    """Loaded as the preprocess job loads it, so a missing eos token stops the plan, not the job."""
    if not model_dir or not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        return []  # file_missing says so
    from trainer.data.hf_tokenizer import load_hf_tokenizer
    from trainer.data.tokenizer import TokenizerFileError

    try:
        load_hf_tokenizer(model_dir)
    except TokenizerFileError as err:
        return [Problem("tokenizer_invalid", "tokenizer.model", model_dir, str(err),
                        "point tokenizer.model at a tokenizer directory with an eos token")]
    return []


def image_problems(cfg: SlipwayConfig) -> list[Problem]:
    image = cfg.container.image
    if cfg.container.kind != "pyxis" or not image or not image_is_file(image) or not os.path.isfile(image):
        return []  # a reference (validate.py) or a missing file (file_missing)
    with open(image, "rb") as f:
        magic = f.read(len(SQUASHFS_MAGIC))
    if magic == SQUASHFS_MAGIC:
        return []
    return [Problem("container_image_format", "container.image", image,
                    "is not a squashfs file, which is what pyxis starts (an Apptainer .sif is not one)",
                    "build one with containers/build_sqsh.sh, or use a .sif with container=apptainer_ngc")]


def input_problems(cfg: SlipwayConfig) -> list[Problem]:
    return data_problems(cfg) + tokenizer_problems(cfg) + image_problems(cfg)
