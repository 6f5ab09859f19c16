"""End-to-end preprocessing throughput on the standard-library corpus, against HF tokenizers in the same run.

Slipway: ``preprocess()`` from JSONL on disk to a published ``.bin/.idx`` pair, timed as a whole (tokenizer
load and its equivalence proof, worker start-up, parsing, tokenizing, writing). Baseline: HF ``tokenizers``
``encode_batch`` of the same documents already in memory (no JSON parsing, no writing: generous to it).
Both on the same cores, interleaved, best of ``--repeats``; the ids are checked identical. The machine is
shared, so the load average before and after is recorded with the figures.

    python bench/preprocess.py                  # stdlib corpus (~31 MB), 32768-token BPE trained on it
    python bench/preprocess.py --workers 2 --repeats 3
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from trainer.data import tokenizer as tokenizer_module
from trainer.data.corpus import CorpusConfig, build_corpus
from trainer.data.indexed_dataset import IndexedDataset
from trainer.data.preprocess import PreprocessConfig, preprocess
from trainer.data.train_tokenizer import TokenizerTrainConfig, train_tokenizer

RESULTS = Path(__file__).resolve().parent / "results" / "preprocess.json"


def hf_baseline(vocab: Path, merges: Path, docs: list[str]) -> tuple[float, list[list[int]]]:
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer(str(vocab), str(merges))
    start = time.perf_counter()
    ids = [e.ids for e in tok.encode_batch(docs, add_special_tokens=False)]
    return time.perf_counter() - start, ids


def slipway_run(corpus: Path, vocab: Path, merges: Path, out: Path, workers: int) -> tuple[float, dict]:
    tokenizer_module._CACHE.clear()  # time the load and the equivalence proof too
    start = time.perf_counter()
    summary = preprocess(PreprocessConfig(input=str(corpus), output_prefix=str(out), vocab_file=str(vocab),
                                          merge_file=str(merges), json_keys=["content"], append_eod=True,
                                          workers=workers, progress="none"))
    return time.perf_counter() - start, summary.__dict__


def peak_rss_mb(corpus: Path, n: int, vocab: Path, merges: Path, work: Path, workers: int) -> float:
    """Peak RSS (largest of the CLI process and its workers) preprocessing ``n`` copies of the corpus."""
    import subprocess

    big = work / f"x{n}.jsonl"
    if not big.exists():
        with big.open("wb") as f:
            for _ in range(n):
                f.write(corpus.read_bytes())
    script = ("import resource, sys; from trainer.data.preprocess import main; rc = main(); "
              "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
              "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)")
    cmd = [sys.executable, "-c", script, "--input", str(big), "--output-prefix", str(work / "mem" / f"x{n}"),
           "--vocab-file", str(vocab), "--merge-file", str(merges), "--json-keys", "content",
           "--workers", str(workers), "--progress", "none"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()
    return max(int(out[-1]), int(out[-2])) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--work-dir", default=None, help="keep corpus/tokenizer/outputs here")
    parser.add_argument("--no-memory-check", action="store_true", help="skip the 1x vs 3x corpus RSS check")
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="slipway-bench-"))
    corpus = work / "stdlib.jsonl"
    if not corpus.exists():
        build_corpus(CorpusConfig(output=str(corpus)))
    vocab, merges = work / "tok" / "vocab.json", work / "tok" / "merges.txt"
    if not vocab.exists():
        train_tokenizer(TokenizerTrainConfig([str(corpus)], str(work / "tok"), vocab_size=args.vocab_size))
    docs = [json.loads(line)["content"] for line in corpus.open(encoding="utf-8")]
    text_mb = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    jsonl_mb = corpus.stat().st_size / 1e6
    load_before = os.getloadavg()
    hf_times, ours_times = [], []
    for _ in range(args.repeats):
        seconds, hf_ids = hf_baseline(vocab, merges, docs)
        hf_times.append(seconds)
        seconds, summary = slipway_run(corpus, vocab, merges, work / "out" / "stdlib", args.workers)
        ours_times.append(seconds)
    load_after = os.getloadavg()
    rss = {} if args.no_memory_check else {
        f"x{n}": round(peak_rss_mb(corpus, n, vocab, merges, work, args.workers), 1) for n in (1, 3)}
    eod = summary["eod_id"]
    want = np.concatenate([np.asarray(ids + [eod], dtype=np.uint16) for ids in hf_ids if ids])
    got = np.fromfile(str(work / "out" / "stdlib_content_document.bin"), dtype=np.uint16)
    identical = bool(np.array_equal(got, want)) and IndexedDataset(work / "out" / "stdlib_content_document"
                                                                   ).num_documents == len(docs)
    hf_best, ours_best = min(hf_times), min(ours_times)
    result = {
        "date": dt.datetime.now().isoformat(timespec="seconds"), "machine": platform.node(),
        "cpus": len(os.sched_getaffinity(0)), "python": platform.python_version(),
        "versions": _versions(), "corpus": {"documents": len(docs), "text_mb": round(text_mb, 2),
                                            "jsonl_mb": round(jsonl_mb, 2)},
        "workers": args.workers, "repeats": args.repeats, "backend": summary["backend"],
        "slipway_end_to_end_s": [round(t, 3) for t in ours_times],
        "hf_encode_batch_s": [round(t, 3) for t in hf_times],
        "slipway_text_mb_per_s": round(text_mb / ours_best, 2),
        "slipway_jsonl_mb_per_s": round(jsonl_mb / ours_best, 2),
        "hf_text_mb_per_s": round(text_mb / hf_best, 2),
        "ratio_vs_hf": round(hf_best / ours_best, 2),
        "peak_rss_mb_by_input_copies": rss, "ids_identical": identical,
        "loadavg_before": load_before, "loadavg_after": load_after,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"corpus: {len(docs)} stdlib files, {text_mb:.1f} MB source, {jsonl_mb:.1f} MB JSONL; "
          f"{args.workers} workers; load avg {load_before[0]:.1f} -> {load_after[0]:.1f}")
    print(f"slipway preprocess (end to end): {result['slipway_text_mb_per_s']:.2f} MB/s of source "
          f"({result['slipway_jsonl_mb_per_s']:.2f} MB/s JSONL), best of {ours_times}")
    print(f"HF tokenizers encode_batch     : {result['hf_text_mb_per_s']:.2f} MB/s, best of {hf_times}")
    if rss:
        print(f"peak RSS (largest process), 1x vs 3x corpus: {rss['x1']} MB vs {rss['x3']} MB")
    print(f"ratio: {result['ratio_vs_hf']:.2f}x   ids identical: {identical}   -> {RESULTS}")
    sys.exit(0 if identical else 1)


def _versions() -> dict[str, str]:
    import tiktoken
    import tokenizers

    return {"tiktoken": tiktoken.__version__, "tokenizers": tokenizers.__version__, "numpy": np.__version__}


if __name__ == "__main__":
    main()
