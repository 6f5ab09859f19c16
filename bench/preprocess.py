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
import resource
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


def _cpu() -> float:
    """CPU seconds of this process (all threads) plus its reaped children (pool workers)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def hf_baseline(vocab: Path, merges: Path, docs: list[str]) -> tuple[float, float, list[list[int]]]:
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer(str(vocab), str(merges))
    start, cpu = time.perf_counter(), _cpu()
    ids = [e.ids for e in tok.encode_batch(docs, add_special_tokens=False)]
    return time.perf_counter() - start, _cpu() - cpu, ids


def slipway_run(corpus: Path, vocab: Path, merges: Path, out: Path,
                workers: int) -> tuple[float, float, dict]:
    tokenizer_module._CACHE.clear()  # time the load and the equivalence proof too
    start, cpu = time.perf_counter(), _cpu()
    summary = preprocess(PreprocessConfig(input=str(corpus), output_prefix=str(out), vocab_file=str(vocab),
                                          merge_file=str(merges), json_keys=["content"], append_eod=True,
                                          workers=workers, progress="none"))
    return time.perf_counter() - start, _cpu() - cpu, summary.__dict__


_RSS_SCRIPT = """
import resource, sys
from trainer.data.preprocess import main
rc = main()
# VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so it would report the launcher's peak.
hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM")][0].split()[1]
print(hwm, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(rc)
"""


def peak_rss_mb(corpus: Path, n: int, vocab: Path, merges: Path, work: Path, workers: int) -> dict:
    """Peak RSS of the CLI's main process and of its largest worker on ``n`` copies of the corpus."""
    import subprocess

    big = work / f"x{n}.jsonl"
    if not big.exists():
        with big.open("wb") as f:
            for _ in range(n):
                f.write(corpus.read_bytes())
    cmd = [sys.executable, "-c", _RSS_SCRIPT, "--input", str(big), "--output-prefix",
           str(work / "mem" / f"x{n}"), "--vocab-file", str(vocab), "--merge-file", str(merges),
           "--json-keys", "content", "--workers", str(workers), "--progress", "none"]
    main_kb, worker_kb = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()[-2:]
    return {"input_mb": round(big.stat().st_size / 1e6, 1), "main_mb": round(int(main_kb) / 1024, 1),
            "largest_worker_mb": round(int(worker_kb) / 1024, 1)}


def prepare(work: Path, vocab_size: int) -> tuple[Path, Path, Path]:
    corpus = work / "stdlib.jsonl"
    if not corpus.exists():
        build_corpus(CorpusConfig(output=str(corpus)))
    vocab, merges = work / "tok" / "vocab.json", work / "tok" / "merges.txt"
    if not vocab.exists():
        train_tokenizer(TokenizerTrainConfig([str(corpus)], str(work / "tok"), vocab_size=vocab_size))
    return corpus, vocab, merges


def measure(args: argparse.Namespace, work: Path) -> dict:
    corpus, vocab, merges = prepare(work, args.vocab_size)
    docs = [json.loads(line)["content"] for line in corpus.open(encoding="utf-8")]
    text_mb = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    load_before = os.getloadavg()
    hf, ours = [], []
    for _ in range(args.repeats):  # interleaved, so both see the same load
        *times, hf_ids = hf_baseline(vocab, merges, docs)
        hf.append(times)
        *times, summary = slipway_run(corpus, vocab, merges, work / "out" / "stdlib", args.workers)
        ours.append(times)
    load_after = os.getloadavg()
    want = np.concatenate([np.asarray([*ids, summary["eod_id"]], dtype=np.uint16) for ids in hf_ids if ids])
    got = np.fromfile(work / "out" / "stdlib_content_document.bin", dtype="<u2")
    documents = IndexedDataset(work / "out" / "stdlib_content_document").num_documents
    identical = documents == len(docs) and bool(np.array_equal(got, want))
    rss = {} if args.no_memory_check else {
        f"x{n}": peak_rss_mb(corpus, n, vocab, merges, work, args.workers) for n in (1, 3)}
    (hf_wall, hf_cpu), (our_wall, our_cpu) = min(hf), min(ours)
    cores = min(args.workers, len(os.sched_getaffinity(0)))
    return {
        "date": dt.datetime.now().isoformat(timespec="seconds"), "machine": platform.node(),
        "cpus": len(os.sched_getaffinity(0)), "python": platform.python_version(), "versions": _versions(),
        "corpus": {"documents": len(docs), "text_mb": round(text_mb, 2),
                   "jsonl_mb": round(corpus.stat().st_size / 1e6, 2)},
        "workers": args.workers, "repeats": args.repeats, "backend": summary["backend"],
        "slipway_wall_s": [round(w, 2) for w, _ in ours], "slipway_cpu_s": [round(c, 2) for _, c in ours],
        "hf_wall_s": [round(w, 2) for w, _ in hf], "hf_cpu_s": [round(c, 2) for _, c in hf],
        "slipway_mb_per_s": round(text_mb / our_wall, 2), "hf_mb_per_s": round(text_mb / hf_wall, 2),
        "ratio_wall": round(hf_wall / our_wall, 2),
        # On a shared box wall time mostly measures the neighbours; CPU time spread over the cores used
        # is what an idle machine with that many cores would take.
        f"slipway_mb_per_s_cpu_bound_{cores}_cores": round(text_mb / (our_cpu / cores), 2),
        f"hf_mb_per_s_cpu_bound_{cores}_cores": round(text_mb / (hf_cpu / cores), 2),
        "ratio_cpu": round(hf_cpu / our_cpu, 2),
        "peak_rss_by_input_copies": rss, "ids_identical": identical,
        "loadavg_before": load_before, "loadavg_after": load_after,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--work-dir", default=None, help="keep corpus/tokenizer/outputs here")
    parser.add_argument("--no-memory-check", action="store_true", help="skip the 1x vs 3x corpus RSS check")
    args = parser.parse_args()
    result = measure(args, Path(args.work_dir or tempfile.mkdtemp(prefix="slipway-bench-")))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    for key, value in result.items():
        print(f"{key:>40}: {value}")
    print(f"slipway end to end {result['slipway_mb_per_s']} MB/s vs HF encode_batch {result['hf_mb_per_s']} "
          f"MB/s (wall, load {result['loadavg_before'][0]:.1f}): {result['ratio_wall']}x; CPU time: "
          f"{result['ratio_cpu']}x; ids identical: {result['ids_identical']} -> {RESULTS}")
    sys.exit(0 if result["ids_identical"] else 1)


def _versions() -> dict[str, str]:
    import tiktoken
    import tokenizers

    return {"tiktoken": tiktoken.__version__, "tokenizers": tokenizers.__version__, "numpy": np.__version__}


if __name__ == "__main__":
    main()
