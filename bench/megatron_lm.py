"""Megatron-LM's training side and transformers' v4.27 converter against Slipway, tag by tag (issue 27 §1,
issue 38).

Too heavy for CI (a Megatron-LM tree per tag, a few minutes of CPU), so a bench: each Megatron-LM tag is
``git archive``d from a mirror (as bench/preprocess.py's ``--megatron`` tree) and used unmodified, under
the Python its pyproject asks for (3.12 from core_v0.17: the oracle's ``.make/mcore/python3.12``, made by
``make mcore``, with pyyaml added in the work folder).

(a) **load_checkpoint**: tiny Slipway runs (2 layers, hidden 64, seq 64; 2 iterations on (b)'s data so
    biases and norms are off their init) are saved in each ``checkpoint.format``. In a fresh process per
    tag and run, Megatron-LM itself parses its arguments (the model's flags only: nothing that relaxes
    the checkpoint check, such as --no-position-embedding or --finetune), builds the model with
    ``pretrain_gpt.model_provider`` through ``training.get_model`` (legacy GPTModel with
    ``--use-legacy-models``, Megatron-core GPTModel with the local layer spec otherwise) and loads the
    checkpoint with ``training.checkpointing.load_checkpoint`` (strict, ``--no-load-optim
    --no-load-rng``: Slipway's optimizer layout is its own); its logits on fixed tokens (gathered over
    its tp ranks) are compared with Slipway's own GPT on the same files. Every tag loads the GPT-2 runs
    in the legacy and mcore formats at tp 1; core_v0.19.0 (no legacy model any more) loads GPT-2 and
    Llama-style runs (rope base 500000, RMSNorm, SwiGLU, 2 KV groups, no biases, untied head), each
    at tp 1 and 2, in the mcore (``--ckpt-format torch``) and torch_dist formats.
(b) **preprocess**: Megatron-LM's ``tools/preprocess_data.py`` and ``python -m trainer.data.preprocess``
    on the standard-library JSONL (``trainer.data.corpus``) with a BPE trained on it: ``.bin``/``.idx``
    bytes compared.
(c) **transformers v4.27** ``convert_megatron_gpt2_checkpoint.py`` (extracted from the 4.27.4 wheel, run
    with the installed transformers) on each Slipway checkpoint; the HF model's logits vs Slipway's.

Everything runs on CPU (gloo; one process per tp rank). The runtime patches are in
bench/megatron_lm_child.py (Megatron-LM) and :data:`_HF_CONVERT` (transformers), each with its reason; no
file of either project is edited. A part that cannot run prints why and the table says so.

    python bench/megatron_lm.py                                  # tags from the mirror below
    python bench/megatron_lm.py --repo /path/to/Megatron-LM/.git --tags core_v0.8.0 core_v0.19.0
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.meta import ROOT, load, run_meta  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "megatron_lm.txt"
MIRROR = Path("/work/.mirror/NVIDIA+Megatron-LM/repo")
TAGS = ("core_v0.8.0", "core_v0.10.0", "core_v0.13.1", "core_v0.16.1", "core_v0.19.0")
TREE_PATHS = ("megatron", "tools/preprocess_data.py", "pretrain_gpt.py", "gpt_builders.py",
              "model_provider.py", "pyproject.toml")
CHILD = Path(__file__).resolve().parent / "megatron_lm_child.py"
HF_SCRIPT = "transformers/models/megatron_gpt2/convert_megatron_gpt2_checkpoint.py"
MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
         "max_position_embeddings": 64, "hidden_dropout": 0.0, "attention_dropout": 0.0}
LLAMA = {**MODEL, "ffn_hidden_size": 128, "position_embedding": "rope", "rotary_base": 500000.0,
         "normalization": "rmsnorm", "activation": "swiglu", "num_query_groups": 2, "add_bias_linear": False,
         "tie_word_embeddings": False}
# Slipway runs: name -> (model, checkpoint.format, tp). "legacy"/"mcore": GPT-2 at tp 1 (every tag).
RUNS = {"legacy": (MODEL, "legacy", 1), "mcore": (MODEL, "mcore", 1)}
# The grid of core_v0.19.0 (tags without a legacy model): GPT-2 and Llama-style, tp 1 and 2, both formats.
GRID = {f"{family}_{fmt}_tp{tp}": (model, fmt, tp) for family, model in (("gpt", MODEL), ("llama", LLAMA))
        for fmt in ("mcore", "torch_dist") for tp in (1, 2)}
ITERS = 2
TOLERANCE = 1e-4  # fp32, the same math in another order: ~1e-6 expected


# ---------------------------------------------------------------------------------------------------------
# The Slipway side and the orchestration (the parent process).


def extract_tree(repo: Path, tag: str, dest: Path) -> Path:
    """``git archive TAG`` of what the bench runs (paths a tag lacks are left out)."""
    listed = subprocess.run(["git", "-C", str(repo), "ls-tree", "--name-only", tag, *TREE_PATHS],
                            capture_output=True, text=True, check=True).stdout.split()
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", tag, *listed], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def slipway_preprocess(paths: dict, out: Path) -> Path:
    from bench.preprocess import cli_args

    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "trainer.data.preprocess", *cli_args(paths, out / "stdlib", 2)],
                   cwd=ROOT, check=True, capture_output=True)
    return out / "stdlib_content_document"


def slipway_checkpoints(work: Path, paths: dict, data_prefix: Path, runs: dict) -> dict[str, Path]:
    """name -> checkpoint folder of a 2-iteration run of Slipway's trainer for each of ``runs`` (name ->
    (model, checkpoint.format, tp); tp processes under torchrun, CPU, gloo)."""
    out = {}
    for name, (model, fmt, tp) in runs.items():
        cfg = {"run_dir": str(work / f"run_{name}"), "model": dict(model),
               "tokenizer": {"vocab_file": str(paths["vocab"]), "merge_file": str(paths["merges"])},
               "data": {"paths": [str(data_prefix)], "split": "100,0,0", "cache_dir": str(work / "cache")},
               "parallel": {"tp_size": tp, "pp_size": 1},
               "optim": {"lr": 1e-2, "min_lr": 1e-3, "warmup_iters": 1},
               "train": {"micro_batch_size": 2, "global_batch_size": 2, "iters": ITERS, "log_interval": 1,
                         "eval_interval": None, "deterministic": True, "device": "cpu"},
               "checkpoint": {"format": fmt}, "logging": {"wandb": {"mode": "disabled"}}, "kernels": "auto"}
        (work / f"run_{name}.json").write_text(json.dumps(cfg))
        launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}"]
                  if tp > 1 else [sys.executable])
        subprocess.run([*launch, "-m", "trainer.run", "--config", str(work / f"run_{name}.json")], cwd=ROOT,
                       check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        out[name] = work / f"run_{name}" / "checkpoints"
    return out


def slipway_logits(ckpt: Path, ids):
    """Slipway's own GPT (trainer.model, eager, fp32) over the checkpoint's merged weights."""
    import torch

    from trainer.convert.reference import SlipwayGPTSource
    from trainer.convert.shards import load_merged
    from trainer.convert.spec import spec_from_checkpoint

    merged = load_merged(ckpt / f"iter_{ITERS:07d}", ITERS)
    spec = spec_from_checkpoint(merged.args, merged.state, merged.checkpoint_version, None)
    return torch.stack([SlipwayGPTSource(merged.state, spec).logits(row) for row in ids])


def tree_python(tree: Path, work: Path) -> tuple[str, list[str]]:
    """(the Python that runs ``tree``, extra PYTHONPATH entries): this interpreter, or for a tree whose
    pyproject asks for Python >= 3.12 the oracle's 3.12 environment (``make mcore``) with pyyaml (which
    megatron.training imports) installed once into the work folder."""
    from tests.mcore.versions import PY312_ENV

    project = tree / "pyproject.toml"
    needs = project.is_file() and 'requires-python = ">=3.12"' in project.read_text()
    if not needs or sys.version_info >= (3, 12):
        return sys.executable, []
    python = PY312_ENV / "bin" / "python"
    if not python.is_file():
        raise RuntimeError(f"{tree.name} needs Python 3.12: run make mcore (it makes {PY312_ENV})")
    deps = work / "py312-deps"
    if not (deps / "yaml").is_dir():
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--target", str(deps), "pyyaml"],
                       check=True, capture_output=True, timeout=300)
    return str(python), [str(deps)]


def megatron_logits(tree: Path, ckpt: Path, job: dict, paths: dict, ctx: dict, work: Path) -> dict:
    """Megatron-LM from ``tree`` loads ``ckpt`` (``job``: model, kind legacy/mcore, format torch /
    torch_dist, tp) in a fresh process with ``tp`` forked ranks."""
    import numpy as np

    work.mkdir(parents=True, exist_ok=True)
    job = {**job, "load": str(ckpt), "vocab": str(paths["vocab"]), "merges": str(paths["merges"]),
           "tokens": str(ctx["tokens"]), "out": str(work / "logits.npy"),
           "summary": str(work / "summary.json"),
           "store": str(work / "store")}
    (work / "job.json").write_text(json.dumps(job))
    # bench/preprocess.py's import-time stand-ins: core_v0.8.0 imports pkg_resources (for its packaging).
    from bench.preprocess import _megatron_shims

    python, extra = tree_python(tree, ctx["work"])
    path = [str(tree), *extra, str(_megatron_shims(work))]
    # CUDA_DEVICE_MAX_CONNECTIONS=1: what Megatron-LM's launch scripts export; validate_args insists on it.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "TORCHDYNAMO_DISABLE": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run([python, str(CHILD), str(work / "job.json")], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=600)
    # Exit status 0 is not enough: load_checkpoint prints a failed torch.load and calls sys.exit().
    if proc.returncode != 0 or not (work / "summary.json").exists():
        return {"error": _last_error(proc.stdout + proc.stderr)}
    return {**json.loads((work / "summary.json").read_text()), "logits": np.load(work / "logits.npy"),
            "seconds": round(time.perf_counter() - t0, 1)}


def _last_error(output: str) -> str:
    """The exception line of a failed child (the last line that names an Error/Exception)."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "Exception" in ln or ln.startswith("AssertionError")]
    return (errors or lines or ["(no output)"])[-1][:300]


def megatron_preprocess(tree: Path, paths: dict, out: Path, ours: Path, work: Path) -> dict:
    """Megatron-LM's tools/preprocess_data.py (2 workers, bench/preprocess.py's flags and import-time
    stand-ins) on the same JSONL; its .bin/.idx compared byte for byte with Slipway's."""
    from bench.preprocess import _megatron_shims

    out.mkdir(parents=True, exist_ok=True)
    # preprocess_child runs tools/preprocess_data.py with these arguments.
    python, extra = tree_python(tree, work.parent)
    cmd = [python, str(CHILD), "--preprocess", "--input", str(paths["corpus"]),
           "--output-prefix", str(out / "stdlib"), "--json-keys", "content", "--tokenizer-type",
           "GPT2BPETokenizer", "--vocab-file", str(paths["vocab"]), "--merge-file", str(paths["merges"]),
           "--append-eod", "--workers", "2"]
    if "legacy_tokenizer" in (tree / "tools" / "preprocess_data.py").read_text():
        # core_v0.16's default tokenizer system builds GPT2BPETokenizer through HF AutoTokenizer("gpt2"),
        # which needs the Hub even with vocab and merges given; --legacy-tokenizer is Megatron's own
        # GPT-2 BPE from the two files, the tokenizer every earlier tag uses.
        cmd.append("--legacy-tokenizer")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *extra, str(_megatron_shims(work))])}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    seconds = round(time.perf_counter() - t0, 1)
    if proc.returncode != 0 or not (out / "stdlib_content_document.idx").exists():
        return {"error": _last_error(proc.stdout + proc.stderr)}
    same = {}
    for ext in ("bin", "idx"):
        theirs, mine = out / f"stdlib_content_document.{ext}", Path(f"{ours}.{ext}")
        same[ext] = theirs.read_bytes() == mine.read_bytes()
        same[f"{ext}_bytes"] = mine.stat().st_size
    return {**same, "seconds": seconds, "legacy_tokenizer": "--legacy-tokenizer" in cmd}


# transformers v4.27's script under the installed transformers, with two runtime patches:
# 1. torch.load(weights_only=True), torch ≥ 2.6's default, which the 2023 script predates, refuses the
#    checkpoint's argparse.Namespace: allowed by name (narrower than weights_only=False; Slipway's args
#    are plain values).
# 2. AutoTokenizer.from_pretrained("gpt2") (what the script loads for --tokenizer-type GPT2BPETokenizer)
#    needs the Hub, which this machine cannot reach; it gets the run's own vocab.json/merges.txt instead
#    (the script only saves the tokenizer beside the weights; the logits do not depend on it).
_HF_CONVERT = """
import argparse, runpy, sys, torch, transformers
torch.serialization.add_safe_globals([argparse.Namespace])
vocab, merges, script, ckpt = sys.argv[1:5]
transformers.AutoTokenizer.from_pretrained = lambda *a, **k: transformers.GPT2TokenizerFast(
    vocab_file=vocab, merges_file=merges)
sys.argv = [script, ckpt]
runpy.run_path(script, run_name="__main__")
"""


def hf_script(work: Path, wheel: Path | None) -> Path:
    """convert_megatron_gpt2_checkpoint.py from the transformers 4.27.4 wheel (``pip download``)."""
    if wheel is None:
        (work / "wheel").mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                        "-d", str(work / "wheel"), "transformers==4.27.4"], check=True, capture_output=True,
                       timeout=300)
        wheel = next((work / "wheel").glob("transformers-4.27.4-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(HF_SCRIPT, work / "hf427")
    return work / "hf427" / HF_SCRIPT


def hf_convert_logits(script: Path, ckpt: Path, paths: dict, ids, work: Path) -> dict:
    """Run the v4.27 script on the checkpoint's one shard (copied: it writes beside its input) and the HF
    model's logits on ``ids``."""
    import shutil

    import torch
    import transformers

    work.mkdir(parents=True, exist_ok=True)
    shard = work / "model_optim_rng.pt"
    shutil.copy(ckpt / f"iter_{ITERS:07d}" / "mp_rank_00" / "model_optim_rng.pt", shard)
    proc = subprocess.run([sys.executable, "-c", _HF_CONVERT, str(paths["vocab"]), str(paths["merges"]),
                           str(script), str(shard)], cwd=work, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if proc.returncode != 0:
        return {"error": _last_error(proc.stdout + proc.stderr)}
    transformers.logging.set_verbosity_error()  # the load report lists the 4.27 attn.masked_bias buffers
    transformers.logging.disable_progress_bar()
    model = transformers.GPT2LMHeadModel.from_pretrained(work).eval()
    with torch.no_grad():
        return {"logits": model(ids).logits.numpy(),
                "activation": model.config.activation_function}


def _diff(theirs, ours) -> float:
    """max |logit difference| over the real vocab (Megatron's and HF's logits keep the padding columns)."""
    import numpy as np

    v = ours.shape[-1]
    return float(np.abs(theirs[..., :v] - ours.numpy()).max())


def _verdict(diff: float) -> str:
    return "ok" if diff <= TOLERANCE else "DIFFERS"


def _loads(tree: Path) -> list[tuple[str, str]]:
    """(run, Megatron model kind) pairs a tag loads: the legacy and mcore GPT-2 runs while the tag has the
    legacy model, else the grid (GRID) into the Megatron-core GPTModel."""
    if (tree / "megatron" / "legacy").is_dir():
        return [(name, name) for name in RUNS]
    return [(name, "mcore") for name in GRID]


def load_rows(tag: str, tree: Path, ctx: dict) -> list[tuple[str, ...]]:
    """(a) for one tag: Megatron-LM's load_checkpoint of each run, logits against Slipway's."""
    rows = []
    if not (tree / "megatron" / "legacy").is_dir():
        rows.append((tag, "a", "load_checkpoint, checkpoint.format=legacy → legacy GPTModel",
                     "not applicable: the tag has no legacy model (megatron/legacy removed)", "n/a"))
    for name, kind in _loads(tree):
        model, fmt, tp = {**RUNS, **GRID}[name]
        family = "Llama-style" if model is LLAMA else "GPT-2"
        job = {"model": model, "kind": kind, "format": "torch_dist" if fmt == "torch_dist" else "torch",
               "tp": tp}
        r = megatron_logits(tree, ctx["ckpts"][name], job, ctx["paths"], ctx,
                            ctx["work"] / tag / f"load_{name}")
        what = f"load_checkpoint, {family} checkpoint.format={fmt} at tp {tp} → {kind} GPTModel"
        if "error" in r:
            rows.append((tag, "a", what, f"could not run: {r['error']}", "NOT RUN"))
            continue
        d = _diff(r["logits"], ctx["ours"][name])
        rows.append((tag, "a", what, f"max |Δlogit| {d:.2e} (iteration {r['iteration']}, {r['model_class']}, "
                     f"{r['seconds']} s)", _verdict(d)))
        seen = ctx["patches"].setdefault(tag, [])
        seen += [n for n in r["patches"] if n not in seen]
    return rows


def tag_rows(tag: str, tree: Path, ctx: dict) -> list[tuple[str, ...]]:
    """(a) and (b) for one Megatron-LM tag: table rows (tag, part, what, result, verdict)."""
    rows = load_rows(tag, tree, ctx)
    what = "tools/preprocess_data.py vs trainer.data.preprocess (.bin/.idx bytes)"
    if not (tree / "megatron" / "training" / "tokenizer").is_dir():
        return rows + [(tag, "b", what, "not applicable here: from core_v0.17 GPT2BPETokenizer is Hugging "
                        "Face's AutoTokenizer('gpt2'), which needs the Hub (this machine has no access)",
                        "n/a")]
    r = megatron_preprocess(tree, ctx["paths"], ctx["work"] / tag / "preprocess", ctx["prefix"],
                            ctx["work"] / tag)
    if "error" in r:
        rows.append((tag, "b", what, f"could not run: {r['error']}", "NOT RUN"))
    else:
        same = r["bin"] and r["idx"]
        rows.append((tag, "b", what, f".bin {r['bin_bytes']:,} B {'identical' if r['bin'] else 'DIFFERENT'}, "
                     f".idx {r['idx_bytes']:,} B {'identical' if r['idx'] else 'DIFFERENT'} "
                     f"(Megatron {r['seconds']} s{', --legacy-tokenizer' if r['legacy_tokenizer'] else ''})",
                     "ok" if same else "DIFFERS"))
    return rows


def hf_rows(ctx: dict, wheel: Path | None) -> list[tuple[str, ...]]:
    """(c): transformers v4.27's converter on each Slipway checkpoint format."""
    try:
        script = hf_script(ctx["work"], wheel)
    except Exception as e:  # no PyPI: say so in the table
        return [("transformers 4.27.4", "c", "convert_megatron_gpt2_checkpoint.py",
                 f"could not get the script: {e}", "NOT RUN")]
    rows = []
    for fmt in ("legacy", "mcore"):
        r = hf_convert_logits(script, ctx["ckpts"][fmt], ctx["paths"], ctx["ids"], ctx["work"] / f"hf_{fmt}")
        what = f"convert_megatron_gpt2_checkpoint.py, checkpoint.format={fmt} → GPT2LMHeadModel"
        if "error" in r and fmt == "mcore" and "language_model" in r["error"]:
            # Expected: the 2023 script reads model["language_model"] only (it predates Megatron-core).
            rows.append(("transformers 4.27.4", "c", what, "not applicable: the script reads legacy names "
                         f"only ({r['error']})", "n/a"))
            continue
        if "error" in r:
            rows.append(("transformers 4.27.4", "c", what, f"could not run: {r['error']}", "NOT RUN"))
            continue
        d = _diff(r["logits"], ctx["ours"][fmt])
        rows.append(("transformers 4.27.4", "c", what,
                     f"max |Δlogit| {d:.2e} (activation {r['activation']})", _verdict(d)))
    return rows


def prepare(work: Path, vocab_size: int, grid: bool) -> dict:
    """Corpus, tokenizer, Slipway's .bin/.idx, the checkpoints (RUNS, and GRID when a tag loads it), fixed
    tokens and Slipway's logits."""
    import numpy as np
    import torch

    from bench.preprocess import prepare as corpus_and_tokenizer

    paths = corpus_and_tokenizer(work, vocab_size)
    prefix = slipway_preprocess(paths, work / "slipway")
    ckpts = slipway_checkpoints(work, paths, prefix, {**RUNS, **(GRID if grid else {})})
    ids = torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    np.save(work / "ids.npy", ids.numpy())
    ours = {fmt: slipway_logits(ckpt, ids) for fmt, ckpt in ckpts.items()}
    return {"work": work, "paths": paths, "prefix": prefix, "ckpts": ckpts, "ids": ids,
            "tokens": work / "ids.npy", "ours": ours, "patches": {}, "commits": {}}


def report(meta: dict, rows: list[tuple[str, ...]], patches: dict[str, list[str]], argv: list[str]) -> str:
    widths = [max(len(r[i]) for r in rows + [("tag", "part", "what", "result", "verdict")]) for i in range(5)]
    lines = [f"# python bench/megatron_lm.py {' '.join(argv)}".rstrip(),
             f"# date {meta['date']}; machine: {meta['machine']}; load before {meta['load_before']}, "
             f"after {load()}; commit {meta['commit']}",
             f"# python {meta['python']}, {meta['versions']}",
             f"# {meta['megatron_lm']}",
             f"# model: {MODEL['num_layers']} layers, hidden {MODEL['hidden_size']}, "
             f"{MODEL['num_attention_heads']} heads, seq {MODEL['seq_length']}, {ITERS} iterations of "
             f"Slipway's trainer; logits on 2 × 16 fixed tokens, fp32; tolerance {TOLERANCE:g}",
             f"# Slipway's logits: max |logit| {meta['scale']:.3f}; |Δlogit| is against them",
             f"# Llama-style (core_v0.19.0 rows): {LLAMA['position_embedding']} base "
             f"{LLAMA['rotary_base']:g}, RMSNorm, SwiGLU (ffn {LLAMA['ffn_hidden_size']}), "
             f"{LLAMA['num_query_groups']} KV groups, no biases, untied head",
             *(f"# {tag} runtime patches (bench/megatron_lm_child.py): {'; '.join(names)}"
               for tag, names in patches.items()),
             "# transformers 4.27 script patches: torch.load allows argparse.Namespace; "
             "AutoTokenizer('gpt2') → the run's vocab/merges (no Hub)"]
    for r in [("tag", "part", "what", "result", "verdict"), tuple("-" * w for w in widths), *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return "\n".join(lines) + "\n"


def _versions() -> str:
    import numpy
    import torch
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}, numpy {numpy.__version__}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repo", type=Path, default=Path(os.environ.get("MEGATRON_LM_REPO", MIRROR)),
                   help="a Megatron-LM git directory (a clone's .git or a bare mirror) holding the tags")
    p.add_argument("--tags", nargs="+", default=list(TAGS))
    p.add_argument("--vocab-size", type=int, default=2048, help="the BPE trained on the corpus")
    p.add_argument("--transformers-wheel", type=Path, help="transformers-4.27.4 wheel (else pip download)")
    p.add_argument("--work", type=Path, help="keep the work files here (default: a temporary folder)")
    p.add_argument("--no-save", action="store_true", help=f"do not write {RESULTS.relative_to(ROOT)}")
    a = p.parse_args(argv)
    meta = {**run_meta(), "versions": _versions()}
    with tempfile.TemporaryDirectory() as tmp:
        work = a.work or Path(tmp)
        trees = {tag: _tree(a.repo, tag, work) for tag in a.tags}
        grid = any(isinstance(t, Path) and not (t / "megatron" / "legacy").is_dir() for t in trees.values())
        ctx = prepare(work, a.vocab_size, grid)
        print("bench/megatron_lm.py: transformers 4.27.4's converter", file=sys.stderr, flush=True)
        rows = hf_rows(ctx, a.transformers_wheel)
        for tag, tree in trees.items():
            rows += _one_tag(a.repo, tag, tree, ctx)
    tags = ", ".join(f"{t} = {c}" for t, c in ctx["commits"].items())
    meta["scale"] = max(float(v.abs().max()) for v in ctx["ours"].values())
    meta["megatron_lm"] = f"Megatron-LM from {a.repo}: {tags}"
    text = report(meta, rows, ctx["patches"], sys.argv[1:] if argv is None else argv)
    print(text, end="")
    if not a.no_save:
        RESULTS.write_text(text)
    return 0 if all(r[4] in ("ok", "n/a") for r in rows) else 1


def _tree(repo: Path, tag: str, work: Path) -> Path | str:
    """The tag's tree, or why it cannot be had (no mirror, no such tag)."""
    try:
        return extract_tree(repo, tag, work / tag / "tree")
    except (OSError, subprocess.CalledProcessError) as e:
        why = getattr(e, "stderr", b"") or str(e)
        return (why.decode(errors="replace") if isinstance(why, bytes) else why).strip()[:200]


def _one_tag(repo: Path, tag: str, tree: Path | str, ctx: dict) -> list[tuple[str, ...]]:
    """A tag's rows, or one row saying why it could not run (no mirror, no such tag, a crash here)."""
    if isinstance(tree, str):
        return [(tag, "a, b", f"git archive from {repo}", f"could not run: {tree}", "NOT RUN")]
    ctx["commits"][tag] = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=10",
                                          f"{tag}^{{commit}}"], capture_output=True, text=True,
                                         check=True).stdout.strip()
    print(f"bench/megatron_lm.py: {tag} ({ctx['commits'][tag]}): load_checkpoint ×{len(_loads(tree))}, "
          "preprocess_data.py", file=sys.stderr, flush=True)
    try:
        return tag_rows(tag, tree, ctx)
    except Exception:
        return [(tag, "a, b", "harness", f"could not run: {traceback.format_exc().splitlines()[-1]}",
                 "NOT RUN")]


if __name__ == "__main__":
    sys.exit(main())
