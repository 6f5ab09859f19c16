"""Whole-process preprocessing time on the standard-library corpus, next to HF tokenizers, in the same run.

Headline: the wall time of ``python -m trainer.data.preprocess`` as a user runs it (a fresh process:
interpreter start, imports, tokenizer load and its equivalence proof, worker start-up, JSON parsing,
tokenizing, writing and publishing the ``.bin/.idx``, exit), ``--repeats`` runs, median and min–max.
Interleaved with it, run for run:

- baseline: HF ``tokenizers``, also a whole process: read and parse the JSONL, ``ByteLevelBPETokenizer``
  ``encode_batch`` (Rust threads on every core); it writes nothing (generous to it). Its ids are checked
  equal to Slipway's ``.bin`` (the digest step is timed and left out of its wall time);
- ceiling: tiktoken alone, ``encode_ordinary`` of the already-parsed documents split evenly (by bytes)
  over ``--workers`` forked processes, timed from fork to join: tokenizing with no start-up, no parsing,
  no writing, perfectly balanced;
- with ``--megatron DIR``: Megatron-LM's own ``tools/preprocess_data.py`` from a checkout or ``git archive``
  of Megatron-LM in DIR (core_v0.8.0 measured; 2 workers, the same flags), its output checked byte-identical.
  Two import-time stand-ins are put on its PYTHONPATH, neither on the path it runs: ``pkg_resources``
  (only ``packaging`` is used; newer setuptools dropped the module) and ``nltk.tokenize.punkt`` (core_v0.8.0
  subclasses ``PunktLanguageVars`` at import even without ``--split-sentences``);
- with ``--before DIR``: the same CLI from another source tree (``git archive SHA trainer | tar -x -C
  DIR``), e.g. the commit before a change.

CPU time (process + reaped children) ÷ cores is printed too; it is not the verdict. ``--breakdown``
times the phases inside the CLI process and, in isolation, what the changes of commit aa78fa6 removed
(the old tokenizer proof and tiktoken's ``encode_to_numpy``). The load average is recorded per run.

    python bench/preprocess.py                          # 5 interleaved runs, 2 workers, breakdown
    python bench/preprocess.py --repeats 3 --before /tmp/old --megatron /tmp/megatron --no-memory-check
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.meta import ROOT, load, run_meta  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "preprocess.json"
MEGATRON_IDLE_S = 16.7  # the figure: Megatron-LM's preprocess_data.py, 2 workers, idle 2-core box

_HF_SCRIPT = """
import hashlib, json, sys, time
from array import array
from tokenizers import ByteLevelBPETokenizer
corpus, vocab, merges, eod = sys.argv[1:5]
tok = ByteLevelBPETokenizer(vocab, merges)
docs = [json.loads(line)["content"] for line in open(corpus, encoding="utf-8")]
ids = [e.ids for e in tok.encode_batch(docs, add_special_tokens=False)]
t0 = time.perf_counter()
out = array("H")
for d in ids:
    if d:
        out.extend(d)
        out.append(int(eod))
print(hashlib.sha256(out.tobytes()).hexdigest(), time.perf_counter() - t0)
"""

# Phases inside one CLI process (the clock starts at its first line; the parent adds start-up and exit).
_PHASE_SCRIPT = """
import time
T0 = time.perf_counter()
import json, sys
import trainer.data.preprocess as P
import trainer.data.tokenizer as T
marks = {"imports": time.perf_counter() - T0}
def timed(module, name, key):
    fn = getattr(module, name)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            marks[key] = marks.get(key, 0.0) + time.perf_counter() - t
    setattr(module, name, wrapper)
for name, key in [("read_vocab", "read vocab.json"), ("read_merges", "read merges.txt"),
                  ("tiktoken_ranks", "equivalence proof"), ("_build_tiktoken", "build tiktoken Encoding")]:
    timed(T, name, key)
timed(P, "load_gpt2_bpe", "tokenizer load (all)")
timed(P, "_pool", "worker start-up (fork)")
encoded = P._encoded
def loop(*a):
    t = time.perf_counter()
    for i, item in enumerate(encoded(*a)):
        if i == 0:
            marks["first chunk back"] = time.perf_counter() - t
        yield item
    marks["parse + tokenize + write loop"] = time.perf_counter() - t
    marks["_loop_end"] = time.perf_counter()
P._encoded = loop
rc = P.main(sys.argv[1:])
end = time.perf_counter()
marks["publish, shutdown, summary"] = end - marks.pop("_loop_end")
marks["in-process total"] = end - T0
print(json.dumps(marks))
sys.exit(rc)
"""

_RSS_SCRIPT = """
import resource, sys
from trainer.data.preprocess import main
rc = main()
# VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so it would report the launcher's peak.
hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM")][0].split()[1]
print(hwm, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(rc)
"""


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed_process(cmd: list[str], cwd: Path = ROOT, env: dict | None = None) -> dict:
    """Wall and CPU seconds (the process and every descendant it waited for), its stdout, the load before."""
    load1 = load()[0]
    cpu0, t0 = _children_cpu(), time.perf_counter()
    out = subprocess.run(cmd, cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout
    return {"wall_s": time.perf_counter() - t0, "cpu_s": _children_cpu() - cpu0, "load1": load1,
            "stdout": out}


def cli_args(paths: dict, out_prefix: Path, workers: int) -> list[str]:
    return ["--input", str(paths["corpus"]), "--output-prefix", str(out_prefix), "--vocab-file",
            str(paths["vocab"]), "--merge-file", str(paths["merges"]), "--json-keys", "content",
            "--append-eod", "--workers", str(workers), "--progress", "none"]


def _encode_group(enc, docs: list[str]) -> None:
    for d in docs:
        enc.encode_ordinary(d)


def ceiling(enc, docs: list[str], workers: int) -> dict:
    """tiktoken alone: the documents over ``workers`` forked processes, balanced by bytes (largest first)."""
    import multiprocessing as mp

    groups: list[list[str]] = [[] for _ in range(workers)]
    sizes = [0] * workers
    for d in sorted(docs, key=len, reverse=True):
        i = sizes.index(min(sizes))
        groups[i].append(d)
        sizes[i] += len(d)
    ctx = mp.get_context("fork")
    load1 = load()[0]
    cpu0, t0 = _children_cpu(), time.perf_counter()
    procs = [ctx.Process(target=_encode_group, args=(enc, g)) for g in groups]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return {"wall_s": time.perf_counter() - t0, "cpu_s": _children_cpu() - cpu0, "load1": load1}


def prepare(work: Path, vocab_size: int) -> dict:
    from trainer.config import CorpusConfig
    from trainer.data.corpus import build_corpus
    from trainer.data.train_tokenizer import TokenizerTrainConfig, train_tokenizer

    corpus = work / "stdlib.jsonl"
    if not corpus.exists():
        build_corpus(CorpusConfig(), str(corpus))
    vocab, merges = work / "tok" / "vocab.json", work / "tok" / "merges.txt"
    if not vocab.exists():
        train_tokenizer(TokenizerTrainConfig([str(corpus)], str(work / "tok"), vocab_size=vocab_size))
    return {"corpus": corpus, "vocab": vocab, "merges": merges}


def interleaved(args: argparse.Namespace, paths: dict, work: Path, docs: list[str], tok) -> dict:
    """Every arm once per repetition, in turn, so that all see the same drifting machine load."""
    py = sys.executable
    arms: dict[str, list[dict]] = {"slipway": [], "hf": [], "ceiling": []}
    if args.before:
        arms["before"] = []
    if args.megatron:
        arms["megatron"] = []
        meg_cmd = [py, str(Path(args.megatron) / "tools" / "preprocess_data.py"),
                   "--input", str(paths["corpus"]), "--output-prefix", str(work / "megatron" / "stdlib"),
                   "--json-keys", "content",
                   "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(paths["vocab"]),
                   "--merge-file", str(paths["merges"]), "--append-eod", "--workers", str(args.workers)]
        meg_env = {**os.environ, "PYTHONPATH": str(_megatron_shims(work))}
        (work / "megatron").mkdir(exist_ok=True)
    hf_cmd = [py, "-c", _HF_SCRIPT, str(paths["corpus"]), str(paths["vocab"]), str(paths["merges"]),
              str(tok.eod_id)]
    for _ in range(args.repeats):
        arms["slipway"].append(timed_process(
            [py, "-m", "trainer.data.preprocess", *cli_args(paths, work / "out" / "stdlib", args.workers)]))
        hf = timed_process(hf_cmd)
        digest, digest_s = hf.pop("stdout").split()
        hf["wall_s"] -= float(digest_s)
        hf["digest"] = digest
        arms["hf"].append(hf)
        arms["ceiling"].append(ceiling(tok._tiktoken, docs, args.workers))
        if args.before:
            arms["before"].append(timed_process(
                [py, "-m", "trainer.data.preprocess",
                 *cli_args(paths, work / "before" / "stdlib", args.workers)], cwd=Path(args.before)))
        if args.megatron:
            arms["megatron"].append(timed_process(meg_cmd, cwd=Path(args.megatron), env=meg_env))
    for runs in arms.values():
        for r in runs:
            r.pop("stdout", None)
    return arms


def check_output(work: Path, docs: list[str], arms: dict) -> bool:
    from trainer.data.indexed_dataset import IndexedDataset

    prefix = work / "out" / "stdlib_content_document"
    digest = hashlib.sha256(Path(f"{prefix}.bin").read_bytes()).hexdigest()
    same = all(r["digest"] == digest for r in arms["hf"])
    same = same and IndexedDataset(prefix).num_documents == len(docs)
    for other in ("before", "megatron"):
        if other in arms:
            for ext in ("bin", "idx"):
                theirs = Path(work / other / f"stdlib_content_document.{ext}").read_bytes()
                same = same and theirs == Path(f"{prefix}.{ext}").read_bytes()
    return same


def _megatron_shims(work: Path) -> Path:
    """Import-time stand-ins for Megatron-LM core_v0.8.0's preprocess_data.py (see the module doc)."""
    shim = work / "megatron_shims"
    files = {"pkg_resources/__init__.py": "import packaging\nimport packaging.version\n",
             "nltk/__init__.py": "from . import tokenize\n",
             "nltk/tokenize/__init__.py": "from . import punkt\n",
             "nltk/tokenize/punkt.py": "class PunktLanguageVars:  # used only by --split-sentences\n"
                                       "    pass\n"}
    for name, text in files.items():
        (shim / name).parent.mkdir(parents=True, exist_ok=True)
        (shim / name).write_text(text)
    return shim


def summarize(runs: list[dict], text_mb: float) -> dict:
    walls = [r["wall_s"] for r in runs]
    med = statistics.median(walls)
    rows = [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items() if k != "digest"}
            for r in runs]
    cpu = statistics.median(r["cpu_s"] for r in runs)
    return {"wall_median_s": round(med, 3), "wall_min_s": round(min(walls), 3),
            "wall_max_s": round(max(walls), 3), "cpu_median_s": round(cpu, 3),
            "mb_per_s_wall": round(text_mb / med, 2), "runs": rows}


def breakdown(paths: dict, work: Path, args: argparse.Namespace, docs: list[str], tok,
              repeats: int = 3) -> dict:
    """Phases of the CLI (medians of ``repeats`` runs, alternating with the ``--before`` tree's when given)
    and the removed costs, timed in isolation."""
    trees = {"phases_median_s": ROOT}
    if args.before:
        trees["before_phases_median_s"] = Path(args.before)
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for _ in range(repeats):
        for name, tree in trees.items():
            cmd = [sys.executable, "-c", _PHASE_SCRIPT, *cli_args(paths, work / "phase" / "s", args.workers)]
            r = timed_process(cmd, cwd=tree)
            marks = json.loads(r["stdout"].strip().splitlines()[-1])
            marks["interpreter start-up and exit"] = r["wall_s"] - marks["in-process total"]
            marks["whole process (wall)"] = r["wall_s"]
            runs[name].append(marks)
    out: dict = {name: {k: round(statistics.median(m[k] for m in rs), 3) for k in rs[0]}
                 for name, rs in runs.items()}
    return {**out, "load_after": load(), "removed": removed_costs(paths, docs, tok)}


def removed_costs(paths: dict, docs: list[str], tok) -> dict:
    """CPU seconds, best of 2 alternating runs: the proof's condition C the old way (GPT-2 BPE run on every
    merge result) and the new way, and tiktoken's encode_to_numpy against encode_ordinary into an array."""
    from array import array

    from trainer.data.bpe_equivalence import _bpe, _not_self_encoding
    from trainer.data.tokenizer import read_merges

    merges = read_merges(paths["merges"])
    rank = {pair: i for i, pair in enumerate(merges)}
    enc = tok._tiktoken

    def old_c() -> None:
        for a, b in merges:
            if len(a + b) > 2:
                _bpe(a + b, rank)

    def to_numpy() -> None:
        for d in docs:
            enc.encode_to_numpy(d, allowed_special=set(), disallowed_special=())

    def ordinary() -> None:
        out = array("I")
        for d in docs:
            out.extend(enc.encode_ordinary(d))

    pairs = {"condition C": (old_c, lambda: _not_self_encoding(merges, rank)),
             "tokenize the corpus, 1 process": (to_numpy, ordinary)}
    out = {}
    for name, (old, new) in pairs.items():
        best = [float("inf"), float("inf")]
        for _ in range(2):
            for i, fn in enumerate((old, new)):
                c = time.process_time()
                fn()
                best[i] = min(best[i], time.process_time() - c)
        out[name] = {"before_cpu_s": round(best[0], 3), "after_cpu_s": round(best[1], 3)}
    return out


def peak_rss_mb(paths: dict, n: int, work: Path, workers: int) -> dict:
    """Peak RSS of the CLI's main process and of its largest worker on ``n`` copies of the corpus."""
    big = work / f"x{n}.jsonl"
    if not big.exists():
        big.write_bytes(paths["corpus"].read_bytes() * n)
    cmd = [sys.executable, "-c", _RSS_SCRIPT,
           *cli_args({**paths, "corpus": big}, work / "mem" / f"x{n}", workers)]
    main_kb, worker_kb = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()[-2:]
    return {"input_mb": round(big.stat().st_size / 1e6, 1), "main_mb": round(int(main_kb) / 1024, 1),
            "largest_worker_mb": round(int(worker_kb) / 1024, 1)}


def measure(args: argparse.Namespace, work: Path) -> dict:
    from trainer.data.tokenizer import load_gpt2_bpe

    result = run_meta()
    paths = prepare(work, args.vocab_size)
    docs = [json.loads(line)["content"] for line in paths["corpus"].open(encoding="utf-8")]
    text_mb = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    tok = load_gpt2_bpe(paths["vocab"], paths["merges"])
    arms = interleaved(args, paths, work, docs, tok)
    result["load_after"] = load()
    cores = min(args.workers, len(os.sched_getaffinity(0)))
    result.update({
        "versions": _versions(), "cpus": len(os.sched_getaffinity(0)), "workers": args.workers,
        "corpus": {"documents": len(docs), "text_mb": round(text_mb, 2),
                   "jsonl_mb": round(paths["corpus"].stat().st_size / 1e6, 2)},
        "output_identical": check_output(work, docs, arms),
        "arms": {name: summarize(runs, text_mb) for name, runs in arms.items()},
    })
    a = result["arms"]
    s = a["slipway"]["wall_median_s"]
    result["ratios"] = {
        "hf_over_slipway_wall": round(a["hf"]["wall_median_s"] / s, 2),
        "slipway_over_ceiling_wall": round(s / a["ceiling"]["wall_median_s"], 2),
        f"cpu_bound_mb_per_s_{cores}_cores": round(text_mb / (a["slipway"]["cpu_median_s"] / cores), 2),
    }
    if args.before:
        result["ratios"]["before_over_slipway_wall"] = round(a["before"]["wall_median_s"] / s, 2)
    if not args.megatron:
        key = "megatron_idle_16.7s_over_slipway (not measured here)"
        result["ratios"][key] = round(MEGATRON_IDLE_S / s, 2)
    else:
        meg = a["megatron"]["wall_median_s"]
        result["ratios"]["megatron_over_slipway_wall (same run)"] = round(meg / s, 2)
        # Least-disturbed runs: a burst of other load costs the ~2 s Slipway run far more than a ~15 s one.
        result["ratios"]["megatron_over_slipway_wall_minima"] = round(a["megatron"]["wall_min_s"]
                                                                      / a["slipway"]["wall_min_s"], 2)
        result["ratios"]["megatron_over_hf_wall"] = round(a["megatron"]["wall_median_s"]
                                                          / a["hf"]["wall_median_s"], 2)
    if not args.no_breakdown:
        result["breakdown"] = breakdown(paths, work, args, docs, tok)
    if not args.no_memory_check:
        result["peak_rss_by_input_copies"] = {f"x{n}": peak_rss_mb(paths, n, work, args.workers)
                                              for n in (1, 3)}
    result["load_end"] = load()
    return result


def report(r: dict) -> str:
    lines = [f"commit {r['commit']}  {r['date']}  load {r['load_before']} -> {r['load_end']}  "
             f"corpus {r['corpus']['text_mb']} MB text, {r['workers']} workers"]
    for name, a in r["arms"].items():
        lines.append(f"{name:>8}: wall median {a['wall_median_s']:.2f} s (min {a['wall_min_s']:.2f}, max "
                     f"{a['wall_max_s']:.2f}), {a['mb_per_s_wall']} MB/s, CPU median "
                     f"{a['cpu_median_s']:.2f} s, load1 per run {[x['load1'] for x in a['runs']]}")
    lines += [f"{k}: {v}" for k, v in r["ratios"].items()]
    others = "".join(f", {o} .bin/.idx" for o in ("megatron", "before") if o in r["arms"])
    lines.append(f"output identical (HF ids{others}): {r['output_identical']}")
    bd = r.get("breakdown", {})
    for k, v in bd.get("phases_median_s", {}).items():
        before = bd.get("before_phases_median_s", {}).get(k)
        was = f"   (before: {before:.3f} s)" if before is not None else ""
        lines.append(f"  phase {k:<34} {v:.3f} s{was}")
    for k, v in r.get("breakdown", {}).get("removed", {}).items():
        lines.append(f"  removed: {k}: {v['before_cpu_s']:.3f} -> {v['after_cpu_s']:.3f} CPU s")
    return "\n".join(lines) + "\n"


def _versions() -> dict[str, str]:
    import numpy as np
    import tiktoken
    import tokenizers

    return {"tiktoken": tiktoken.__version__, "tokenizers": tokenizers.__version__, "numpy": np.__version__}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--work-dir", default=None, help="keep corpus/tokenizer/outputs here (reused)")
    parser.add_argument("--before", default=None, help="a source tree whose trainer/ to time as well")
    parser.add_argument("--megatron", default=None,
                        help="a Megatron-LM tree: time its tools/preprocess_data.py too")
    parser.add_argument("--no-breakdown", action="store_true")
    parser.add_argument("--no-memory-check", action="store_true", help="skip the 1x vs 3x corpus RSS check")
    args = parser.parse_args()
    result = measure(args, Path(args.work_dir or tempfile.mkdtemp(prefix="slipway-bench-")))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    sys.stdout.write(report(result) + f"-> {RESULTS}\n")
    return 0 if result["output_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
