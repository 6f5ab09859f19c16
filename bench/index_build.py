"""Time to build the GPT document, sample and shuffle indices for a synthetic 1-billion-token index.

Only sequence lengths are needed (no .bin). The sample index is built by the C++ op and by the NumPy
reference in the same run (the baseline); the document and shuffle indices are NumPy RandomState shuffles
either way. Also times the full cached path (build + atomic .npy writes + their SHA-256) and a cache hit
(every file checked against its recorded SHA-256, then memory-mapped), and how much of the hit is the digest.

    python bench/index_build.py                    # 1e9 tokens, S=2048, 1 and 3 epochs
    python bench/index_build.py --tokens 1e8 --seq-length 1024
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

from trainer.data.index_cache import IndexCacheConfig, load_or_build
from trainer.data.index_helpers import (
    IndexSpec,
    SampleIndexArgs,
    build_document_index,
    build_sample_index_cpp,
    build_sample_index_numpy,
    build_shuffle_index,
    count_epochs,
    last_epoch_plan,
)
from trainer.disk import sha256_file


def synthetic_sizes(total_tokens: int, seed: int = 0) -> np.ndarray:
    """Document lengths drawn log-normally (median ~400, long tail like source files), 1% empty."""
    rng = np.random.default_rng(seed)
    est = int(total_tokens / 700 * 1.2) + 16
    sizes = np.clip(rng.lognormal(6.0, 1.0, est), 1, 200_000).astype(np.int32)
    sizes[rng.random(est) < 0.01] = 0
    cut = int(np.searchsorted(np.cumsum(sizes, dtype=np.int64), total_tokens)) + 1
    if cut > est:
        raise RuntimeError("synthetic size estimate too small; raise the factor")
    return sizes[:cut]


def best_of(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def run_case(sizes: np.ndarray, spec: IndexSpec, repeats: int) -> dict[str, float]:
    doc_ids = np.arange(len(sizes), dtype=np.int32)
    tokens = int(sizes.sum(dtype=np.int64))
    epochs = count_epochs(tokens, spec)
    separate, sans_last = last_epoch_plan(tokens, epochs, spec)
    t_doc, doc_index = best_of(lambda: build_document_index(doc_ids, epochs, np.random.RandomState(spec.seed),
                                                            separate), repeats)
    args = SampleIndexArgs(sizes, doc_index, spec.seq_length, epochs, tokens)
    t_cpp, cpp = best_of(lambda: build_sample_index_cpp(args), repeats)
    t_np, ref = best_of(lambda: build_sample_index_numpy(args), repeats)
    if not np.array_equal(cpp, ref):
        raise AssertionError("C++ and NumPy sample indices differ")
    total = len(cpp) - 1
    t_shuf, _ = best_of(lambda: build_shuffle_index(sans_last if separate else total, total,
                                                    np.random.RandomState(spec.seed)), repeats)
    with tempfile.TemporaryDirectory() as tmp:
        cache = IndexCacheConfig(tmp, is_builder=True)
        t0 = time.perf_counter()
        load_or_build(sizes, (0, len(sizes)), spec, "train", cache, impl="cpp")
        t_cached_build = time.perf_counter() - t0
        t0 = time.perf_counter()
        load_or_build(sizes, (0, len(sizes)), spec, "train", IndexCacheConfig(tmp, is_builder=False))
        t_hit = time.perf_counter() - t0
        arrays = [os.path.join(tmp, f) for f in os.listdir(tmp) if f.endswith(".npy")]
        t_digest, _ = best_of(lambda: [sha256_file(f) for f in arrays], repeats)
        entry_mb = sum(os.path.getsize(f) for f in arrays) / 1e6
    return {"epochs": epochs, "separate": separate, "samples": total, "doc": t_doc, "cpp": t_cpp,
            "numpy": t_np, "shuffle": t_shuf, "cached_build": t_cached_build, "hit": t_hit,
            "digest": t_digest, "entry_mb": entry_mb, "dtype": str(cpp.dtype)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=float, default=1e9)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--epochs", type=float, nargs="+", default=[1.0, 2.5],
                        help="samples requested, in epochs (2.5: three epochs, last one shuffled separately)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    t0 = time.perf_counter()
    sizes = synthetic_sizes(int(args.tokens))
    build_sample_index_cpp(SampleIndexArgs(sizes[:8], np.arange(8, dtype=np.int32), 2, 1,
                                           int(sizes[:8].sum())))  # load the extension outside the timings
    tokens = int(sizes.sum(dtype=np.int64))
    out = sys.stdout
    out.write(f"synthetic index: {len(sizes):,} documents, {tokens:,} tokens "
              f"(generated in {time.perf_counter() - t0:.1f} s); S = {args.seq_length}\n")
    out.write(f"{'request':>10} {'epochs':>6} {'samples':>11} {'doc idx':>8} {'sample C++':>10} "
              f"{'sample NumPy':>12} {'C++ speed-up':>12} {'shuffle':>8} {'all 3 C++':>9} "
              f"{'build+write':>11} {'cache hit':>9} {'entry':>9} {'its digest':>10}\n")
    for ep in args.epochs:
        spec = IndexSpec(args.seq_length, int(ep * (tokens - 1) // args.seq_length), seed=1234)
        r = run_case(sizes, spec, args.repeats)
        three = r["doc"] + r["cpp"] + r["shuffle"]
        speedup = r["numpy"] / r["cpp"]
        out.write(f"{ep:>9.1f}e {r['epochs']:>6} {r['samples']:>11,} {r['doc']:>7.3f}s {r['cpp']:>9.3f}s "
                  f"{r['numpy']:>11.3f}s {speedup:>11.1f}x {r['shuffle']:>7.3f}s {three:>8.3f}s "
                  f"{r['cached_build']:>10.3f}s {r['hit']:>8.3f}s {r['entry_mb']:>6.1f} MB "
                  f"{r['digest']:>9.3f}s   (sample index {r['dtype']}, "
                  f"separate last epoch: {r['separate']})\n")


if __name__ == "__main__":
    main()
