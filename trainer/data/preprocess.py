"""JSONL → Megatron ``{prefix}_{key}_document.bin/.idx``, byte-identical to Megatron-LM's preprocess_data.py.

``python -m trainer.data.preprocess --input 'data/*.jsonl.gz' --output-prefix out/codeparrot
--json-keys content --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt
--append-eod --workers 2`` (Megatron's flags; ``--dataset-impl mmap`` and ``--chunk-size`` from older command
lines are accepted). Python: ``preprocess(PreprocessConfig(...)) -> PreprocessSummary``.

What differs from Megatron is everything around the bytes:
- speed: a tiktoken encoder proven equal to GPT-2 BPE on the given files, in worker processes fed
  newline-aligned chunks, results consumed in order through a bounded window (memory stays flat);
- bad lines never cost data silently: ``on_error="fail"`` stops at the first with file, line and reason;
  ``"skip"`` drops them, counts them by reason and records them in ``{prefix}_summary.json``;
- outputs are written under temporary names and renamed into place only when every pair is complete.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainer.cli import Flags, add_dataclass_args, from_args
from trainer.config_issues import checks_deferred
from trainer.data.hf_tokenizer import (
    HF_TOKENIZER_TYPE,
    TOKENIZER_TYPES,
    AnySpec,
    AnyTokenizer,
    load_hf_tokenizer,
)
from trainer.data.indexed_dataset import (
    IndexedDatasetBuilder,
    best_fitting_dtype,
    data_file_path,
    index_file_path,
    publish,
    temp_pair,
)
from trainer.data.preprocess_io import (
    ON_ERROR,
    REASONS,
    BadLine,
    ChunkResult,
    DiskFullError,
    EncodeSettings,
    disk_full,
    encode_chunk,
    file_size_total,
    init_worker,
    iter_chunks,
    resolve_inputs,
)
from trainer.data.progress import MODES, Progress
from trainer.data.tokenizer import BACKENDS, load_gpt2_bpe
from trainer.data.tokenizer_identity import tokenizer_digest
from trainer.disk import out_of_space
from trainer.log import get_logger
from trainer.run_files import document_prefix, preprocess_summary

log = get_logger("trainer.data.preprocess")

_MAX_EXAMPLES = 20  # skipped lines listed individually in the summary; all are counted


def _default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class EmptyDatasetError(ValueError):
    """The inputs hold no training text: publishing an empty dataset would only fail training later."""


def _check_not_empty(run: _Run, config: PreprocessConfig, files: list[str]) -> None:
    for key in config.json_keys:
        text_tokens = run.tokens.get(key, 0) - (run.documents if config.append_eod else 0)
        if run.documents == 0 or text_tokens <= 0:
            raise EmptyDatasetError(
                f"{', '.join(files[:3])}{' ...' if len(files) > 3 else ''}: no training text under the key "
                f"{key!r} ({run.documents} documents, {max(text_tokens, 0)} tokens of text). Nothing was "
                "written. Point the input at the training text, or set the key that holds it "
                "(--json-keys; data.json_key in launch.py)")


class PreprocessError(ValueError):
    """A bad input line stopped the run (``on_error="fail"``); ``bad`` says where and why. ``skip``: how the
    caller's user asks to drop bad lines (this tool's flag; launch.py's key when the preprocess stage
    re-raises it)."""

    def __init__(self, bad: BadLine, skip: str = "--on-error skip") -> None:
        super().__init__(f"{bad.message()}. Nothing was written. Fix the line, or rerun with "
                         f"{skip} to drop bad lines (they are counted in the summary).")
        self.bad = bad


@dataclass
class PreprocessConfig:
    """One preprocessing run (field names follow Megatron's flags)."""

    input: str
    """A JSONL file (``.jsonl``/``.json``, optionally ``.gz``) or a glob of them, read in sorted order."""
    output_prefix: str
    """Outputs are ``{output_prefix}_{key}_document.bin/.idx`` and ``{output_prefix}_summary.json``."""
    vocab_file: str | None = None
    """GPT2BPETokenizer: the vocab.json."""
    merge_file: str | None = None
    """GPT2BPETokenizer: the merges.txt that goes with vocab_file."""
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    """Fields to tokenize; each key gets its own ``.bin/.idx`` pair with one document per input line."""
    tokenizer_type: str = "GPT2BPETokenizer"
    """GPT2BPETokenizer (vocab_file + merge_file) or HuggingFaceTokenizer (tokenizer_model)."""
    tokenizer_model: str | None = None
    """HuggingFaceTokenizer: a directory with a tokenizer.json (trainer.data.hf_tokenizer)."""
    append_eod: bool = False
    """Append the end-of-document id (GPT-2's ``<|endoftext|>``, a HF tokenizer's eos) to every non-empty
    document (Megatron leaves empty ones empty)."""
    workers: int = field(default_factory=_default_workers)
    """Worker processes; 1 runs everything in this process."""
    log_interval: int = 1000
    """Documents between progress log lines (when not showing a progress bar)."""
    on_error: str = "fail"
    """``fail``: stop at the first bad line. ``skip``: drop bad lines, count them by reason."""
    chunk_bytes: int = 1 << 20
    """Input bytes per work item (whole lines); bounds memory at ~4 × workers × chunk_bytes."""
    backend: str = "auto"
    """Tokenizer backend: auto (tiktoken when provably equal, else HF), tiktoken, or hf."""
    progress: str = "auto"
    """auto (tqdm bar on a terminal, else log lines), bar, log or none."""

    def __post_init__(self) -> None:
        if isinstance(self.json_keys, str):
            self.json_keys = [self.json_keys]
        if not checks_deferred():  # a plan builds it before the tokenizer files exist (the corpus stage's)
            self.check()

    def check(self) -> None:
        """Raise ValueError for a setting this run cannot use (also at the start of :func:`preprocess`:
        a job spec built by a plan is checked where it runs)."""
        self._check_tokenizer()
        if not self.json_keys or len(set(self.json_keys)) != len(self.json_keys):
            raise ValueError(f"json_keys={self.json_keys!r}: give one or more distinct field names")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error={self.on_error!r}: use 'fail' (stop at a bad line) or 'skip'")
        for name in ("workers", "log_interval", "chunk_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be ≥ 1")

    def _check_tokenizer(self) -> None:
        if self.tokenizer_type == HF_TOKENIZER_TYPE:
            if not self.tokenizer_model:
                raise ValueError("tokenizer_type=HuggingFaceTokenizer needs tokenizer_model "
                                 "(--tokenizer-model): the directory holding its tokenizer.json")
            if self.backend == "tiktoken":
                raise ValueError("backend='tiktoken' is for GPT2BPETokenizer only; use 'auto' or 'hf'")
            return
        if self.tokenizer_type != "GPT2BPETokenizer":
            raise ValueError(f"tokenizer_type={self.tokenizer_type!r}: use GPT2BPETokenizer or "
                             f"{HF_TOKENIZER_TYPE}")
        for name in ("vocab_file", "merge_file"):
            if not getattr(self, name) or not Path(getattr(self, name)).is_file():
                raise ValueError(f"{name}={getattr(self, name)!r}: file not found (GPT2BPETokenizer needs "
                                 "--vocab-file and --merge-file)")

    def load_tokenizer(self) -> AnyTokenizer:
        if self.tokenizer_type == HF_TOKENIZER_TYPE:
            return load_hf_tokenizer(self.tokenizer_model)
        return load_gpt2_bpe(self.vocab_file, self.merge_file, self.backend)

    def output_prefix_for(self, key: str) -> str:
        return document_prefix(self.output_prefix, key)

    @property
    def summary_path(self) -> str:
        return preprocess_summary(self.output_prefix)


@dataclass
class PreprocessSummary:
    """What a run read and wrote (also saved as ``{output_prefix}_summary.json``)."""

    outputs: dict[str, str]
    """JSON key → dataset prefix (``.bin``/``.idx`` appended)."""
    inputs: list[str]
    documents: int
    """Documents written per key (= input lines kept)."""
    tokens: dict[str, int]
    skipped: dict[str, int]
    """Dropped lines by reason (invalid_json, missing_key, non_string, invalid_utf8)."""
    skipped_examples: list[dict]
    blank_lines: int
    """Whitespace-only lines (no data; Megatron would crash on them), not counted as documents."""
    input_bytes: int
    seconds: float
    mb_per_s: float
    """Uncompressed JSONL megabytes (1e6) per second, end to end."""
    backend: str
    vocab_size: int
    eod_id: int
    dtype: str
    append_eod: bool
    summary_path: str = ""
    tokenizer_digest: str | None = None  # trainer.data.tokenizer_identity: the training stage compares it


class _Run:
    """Mutable totals of one run."""

    def __init__(self, keys: list[str]) -> None:
        self.documents = self.blank_lines = self.input_bytes = 0
        self.tokens = dict.fromkeys(keys, 0)
        self.skipped: Counter[str] = Counter()
        self.examples: list[BadLine] = []

    def absorb(self, result: ChunkResult, builders: dict[str, IndexedDatasetBuilder], skip: bool) -> None:
        if result.bad and not skip:
            raise PreprocessError(result.bad[0])
        for key, builder in builders.items():
            builder.add_documents(result.tokens[key], result.doc_lengths[key])
            self.tokens[key] += len(result.tokens[key])
        self.documents += result.documents
        self.blank_lines += result.blank_lines
        self.input_bytes += result.input_bytes
        for bad in result.bad:
            self.skipped[bad.reason] += 1
            if len(self.examples) < _MAX_EXAMPLES:
                self.examples.append(bad)
                log.warning("skipped %s", bad.message())


def _pool(config: PreprocessConfig, spec: AnySpec) -> Executor | None:
    if config.workers == 1:
        return None
    # fork shares the parent's already-verified tokenizer; elsewhere each worker loads its own.
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    pool = ProcessPoolExecutor(config.workers, mp_context=mp.get_context(method),
                               initializer=init_worker, initargs=(spec, os.getpid()))
    pool.submit(os.getpid).result()  # start the workers now, before any progress-bar thread exists
    return pool


def _encoded(pool: Executor | None, config: PreprocessConfig, files: list[str],
             settings: EncodeSettings) -> Iterator[tuple[int, ChunkResult]]:
    """(file position, result) per chunk in input order; at most 2 × workers chunks in flight."""
    chunks = iter_chunks(files, config.chunk_bytes)
    if pool is None:
        for chunk in chunks:
            yield chunk.progress_bytes, encode_chunk(chunk, settings)
        return
    window: deque = deque()
    try:
        for chunk in chunks:
            window.append((chunk.progress_bytes, pool.submit(encode_chunk, chunk, settings)))
            if len(window) >= 2 * config.workers:
                position, future = window.popleft()
                yield position, future.result()
        while window:
            position, future = window.popleft()
            yield position, future.result()
    finally:
        for _, future in window:
            future.cancel()


def preprocess(config: PreprocessConfig) -> PreprocessSummary:
    """Run one preprocessing job; raises :class:`PreprocessError` on a bad line in fail mode."""
    config.check()
    files = resolve_inputs(config.input)
    digest = tokenizer_digest(config.tokenizer_type, config.vocab_file, config.merge_file,
                              config.tokenizer_model)  # read before loading: the bytes it then encodes with
    tok = config.load_tokenizer()
    dtype = best_fitting_dtype(tok.vocab_size)
    settings = EncodeSettings(tok.spec, tuple(config.json_keys), config.append_eod,
                              config.on_error == "skip", dtype.str)
    log.info("preprocess: %d input file(s), keys %s, tokenizer %s backend (vocab %d, %s on disk), %d workers",
             len(files), config.json_keys, tok.backend, tok.vocab_size, dtype.name, config.workers)
    outputs = {key: config.output_prefix_for(key) for key in config.json_keys}
    _warn_leftovers(outputs.values())
    temps = {key: temp_pair(prefix) for key, prefix in outputs.items()}
    builders = {key: IndexedDatasetBuilder(temps[key][0], dtype) for key in config.json_keys}
    run = _Run(config.json_keys)
    start = time.perf_counter()
    pool = progress = None
    try:
        pool = _pool(config, tok.spec)
        progress = Progress(file_size_total(files), config.log_interval, config.progress)
        try:
            for position, result in _encoded(pool, config, files, settings):
                run.absorb(result, builders, config.on_error == "skip")
                progress.update(result.documents, result.input_bytes, position)
            for key, builder in builders.items():
                builder.finalize(temps[key][1])
        except OSError as e:  # before the clean-up below: what was written tells what is needed
            if out_of_space(e):
                raise disk_full(e, temps, run.input_bytes, file_size_total(files)) from e
            raise
        _check_not_empty(run, config, files)
        publish([(*temps[key], outputs[key]) for key in config.json_keys])
    except BaseException:
        for builder in builders.values():
            builder.close()
        for pair in temps.values():
            for path in pair:
                Path(path).unlink(missing_ok=True)
        raise
    finally:
        if progress is not None:
            progress.close()
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    seconds = time.perf_counter() - start
    mb_per_s = round(run.input_bytes / seconds / 1e6, 3)
    summary = PreprocessSummary(
        outputs=outputs, inputs=files, documents=run.documents, tokens=run.tokens, skipped=dict(run.skipped),
        skipped_examples=[asdict(b) for b in run.examples], blank_lines=run.blank_lines,
        input_bytes=run.input_bytes, seconds=round(seconds, 3), mb_per_s=mb_per_s,
        backend=tok.backend, vocab_size=tok.vocab_size, eod_id=tok.eod_id, dtype=dtype.name,
        append_eod=config.append_eod, summary_path=config.summary_path, tokenizer_digest=digest)
    _write_summary(summary)
    _report(summary)
    return summary


def _warn_leftovers(prefixes) -> None:
    """Temporary files of killed runs (SIGKILL leaves no chance to clean up) are reported, never deleted:
    on a shared filesystem they may belong to a job still running on another node."""
    for prefix in prefixes:
        folder, name = os.path.split(os.path.abspath(prefix))
        stale = sorted(Path(folder).glob(f".{name}.*.partial")) if os.path.isdir(folder) else []
        if stale:
            log.warning("preprocess: %d temporary file(s) from an interrupted run next to %s (e.g. %s); "
                        "delete them once no other job writes this prefix", len(stale), prefix, stale[0].name)


def _write_summary(summary: PreprocessSummary) -> None:
    tmp = summary.summary_path + f".partial-{os.getpid()}"
    Path(tmp).write_text(json.dumps(asdict(summary), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, summary.summary_path)


def _report(summary: PreprocessSummary) -> None:
    log.info("preprocess: %d documents, %s tokens, %.1f MB in %.1fs (%.2f MB/s)", summary.documents,
             summary.tokens, summary.input_bytes / 1e6, summary.seconds, summary.mb_per_s)
    for prefix in summary.outputs.values():
        log.info("preprocess: wrote %s and %s", data_file_path(prefix), index_file_path(prefix))
    if summary.skipped:
        counts = ", ".join(f"{REASONS[r]}: {n}" for r, n in sorted(summary.skipped.items()))
        log.warning("preprocess: skipped %d bad line(s) (%s); details in %s", sum(summary.skipped.values()),
                    counts, summary.summary_path)
    if summary.blank_lines:
        log.info("preprocess: ignored %d blank line(s)", summary.blank_lines)


# The field names are Megatron's flag names (--input, --output-prefix, --json-keys, --tokenizer-type,
# --vocab-file, --merge-file, --append-eod, --workers): no renames, so Megatron command lines run as they are.
FLAGS = (Flags(PreprocessConfig, options={"tokenizer_type": {"choices": TOKENIZER_TYPES},
                                          "on_error": {"choices": ON_ERROR}, "backend": {"choices": BACKENDS},
                                          "progress": {"choices": MODES}}),)


def build_parser() -> argparse.ArgumentParser:
    """Megatron-LM's preprocess_data.py flags (GPT-2 BPE and HF tokenizer subset) plus Slipway's own."""
    p = argparse.ArgumentParser(prog="python -m trainer.data.preprocess",
                                description="Tokenize JSONL into Megatron .bin/.idx (byte-identical).")
    add_dataclass_args(p, FLAGS[0])
    # Accepted so that Megatron command lines (e.g. the CodeParrot guide's) run unchanged.
    p.add_argument("--dataset-impl", choices=["mmap"], default="mmap", help=argparse.SUPPRESS)
    p.add_argument("--chunk-size", type=int, default=None, help=argparse.SUPPRESS)
    return p


def _terminate(signum, _frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # clean up temporary files as for Ctrl-C


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Slurm's time limit sends SIGTERM first: treat it like Ctrl-C so temporary files are removed.
    signal.signal(signal.SIGTERM, _terminate)
    try:
        summary = preprocess(from_args(FLAGS[0], args))
    except (ValueError, DiskFullError) as e:  # PreprocessError, bad config, unreadable input, a full disk
        log.error("%s", e)
        return 1
    except KeyboardInterrupt:
        log.error("interrupted: temporary files removed, no output written")
        return 130
    sys.stdout.write(f"{summary.documents} documents, {summary.mb_per_s:.2f} MB/s -> "
                     f"{', '.join(summary.outputs.values())} (summary: {summary.summary_path})\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
