"""Megatron-LM's training side and transformers' v4.27 converter against Slipway, tag by tag (issue 27 §1).

Too heavy for CI (a Megatron-LM tree per tag, a few minutes of CPU), so a bench: each Megatron-LM tag is
``git archive``d from a mirror (as bench/preprocess.py's ``--megatron`` tree) and used unmodified.

(a) **load_checkpoint**: a tiny Slipway run (2 layers, hidden 64, seq 64; 2 iterations on (b)'s data so
    biases and norms are off their init) is saved with each ``checkpoint.format`` (legacy, mcore). In a
    fresh process per tag and format, Megatron-LM itself parses its arguments, builds the model with
    ``pretrain_gpt.model_provider`` through ``training.get_model`` (legacy GPTModel with
    ``--use-legacy-models``, Megatron-core GPTModel with the local layer spec otherwise) and loads the
    checkpoint with ``training.checkpointing.load_checkpoint`` (strict, ``--no-load-optim
    --no-load-rng``); its logits on fixed tokens are compared with Slipway's own GPT on the same files.
(b) **preprocess**: Megatron-LM's ``tools/preprocess_data.py`` and ``python -m trainer.data.preprocess``
    on the standard-library JSONL (``trainer.data.corpus``) with a BPE trained on it: ``.bin``/``.idx``
    bytes compared.
(c) **transformers v4.27** ``convert_megatron_gpt2_checkpoint.py`` (extracted from the 4.27.4 wheel, run
    with the installed transformers) on each Slipway checkpoint; the HF model's logits vs Slipway's.

Everything runs on CPU, one process per Megatron run (gloo, world 1). The runtime patches are in
:func:`_cpu_patches` (Megatron-LM) and :data:`_HF_CONVERT` (transformers), each with its reason; no file
of either project is edited. A part that cannot run prints why and the table says so.

    python bench/megatron_lm.py                                  # tags from the mirror below
    python bench/megatron_lm.py --repo /path/to/Megatron-LM/.git --tags core_v0.8.0 core_v0.10.0
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
TAGS = ("core_v0.8.0", "core_v0.10.0", "core_v0.13.1", "core_v0.16.1")
TREE_PATHS = ("megatron", "tools/preprocess_data.py", "pretrain_gpt.py", "gpt_builders.py",
              "model_provider.py")
HF_SCRIPT = "transformers/models/megatron_gpt2/convert_megatron_gpt2_checkpoint.py"
MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
         "max_position_embeddings": 64, "hidden_dropout": 0.0, "attention_dropout": 0.0}
ITERS = 2
TOLERANCE = 1e-4  # fp32, the same math in another order: ~1e-6 expected


# ---------------------------------------------------------------------------------------------------------
# The Megatron-LM side: runs as ``--child JOB`` with one Megatron-LM tree first on PYTHONPATH. Nothing from
# ``trainer`` is imported here (the expected side must not share code with what it checks).


def _cpu_patches() -> list[str]:
    """Runtime stand-ins that Megatron-LM's training code needs on a CPU-only torch; returns their names.
    Each was checked necessary on core_v0.8.0 by leaving it out (the error it then stops with is given).

    1. The legacy model's LayerNorm (``megatron.legacy.model.fused_layer_norm.MixedFusedLayerNorm``)
       imports the ``fused_layer_norm_cuda`` extension in ``__init__`` ("No module named
       'fused_layer_norm_cuda'") and calls apex's ``fused_layer_norm_affine`` (None without apex): an
       empty module stands in for the extension and that module's global becomes ``F.layer_norm``
       (arguments reordered). Not a fake ``apex`` package: Megatron-core's local layer spec would then
       pick apex's FusedLayerNorm over torch's LayerNorm. Legacy model only.
    2. ``get_cuda_rng_tracker().fork`` is a no-op context ("cuda rng state model-parallel-rng is not
       added"): entered around attention dropout (0 here); the tracker gets its states from
       ``model_parallel_cuda_manual_seed``, which ``initialize_megatron`` calls only with a GPU.
    3. ``torch.cuda.current_device()`` names the CPU ("Torch not compiled with CUDA enabled"): tensors
       Megatron creates "on the current device" (the attention scratch buffer that baddbmm uses with
       beta=0, GlobalMemoryBuffer; the model's move in ``get_model``) stay on the CPU.
    4. ``Module.cuda``/``Tensor.cuda`` return self ("Invalid device, must be cuda device"): ``get_model``
       moves the model with ``.cuda(torch.cuda.current_device())``.
    5. ``torch.tensor(..., device='cuda')`` → CPU ("Torch not compiled with CUDA enabled"):
       ``read_metadata`` all-reduces the iteration it read from latest_checkpointed_iteration.txt as a
       CUDA tensor; gloo reduces a CPU one the same.
    6. ``argparse.Namespace`` allowed by ``torch.load(weights_only=True)``, torch ≥ 2.6's default, which
       core_v0.8.0 predates ("Unsupported global: GLOBAL argparse.Namespace"; load_checkpoint prints it
       and exits with status 0): a checkpoint's ``args``. Slipway's are plain values, nothing else.
    """
    import argparse as _argparse
    import contextlib
    import importlib
    import types

    import torch
    import torch.nn.functional as F

    importlib.import_module("pretrain_gpt")  # first: megatron.legacy.model alone is a circular import
    legacy_ln = importlib.import_module("megatron.legacy.model.fused_layer_norm")
    legacy_ln.fused_layer_norm_affine = lambda x, w, b, shape, eps: F.layer_norm(x, shape, w, b, eps)
    sys.modules["fused_layer_norm_cuda"] = types.ModuleType("fused_layer_norm_cuda")
    torch.cuda.current_device = lambda: "cpu"
    torch.nn.Module.cuda = lambda self, *a, **k: self
    torch.Tensor.cuda = lambda self, *a, **k: self
    tensor = torch.tensor

    def cpu_tensor(*a, **k):
        if str(k.get("device", "")).startswith("cuda"):
            k["device"] = "cpu"
        return tensor(*a, **k)

    torch.tensor = cpu_tensor
    torch.serialization.add_safe_globals([_argparse.Namespace])
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    return ["legacy LayerNorm: apex → F.layer_norm", "CUDA RNG tracker fork → no-op", "current_device → cpu",
            ".cuda() → identity", "torch.tensor(device=cuda) → cpu", "weights_only: allow Namespace"]


def _triton_stand_in() -> list[str]:
    """7. Only where triton is not installed (a CPU torch): from core_v0.16 ``import megatron.training``
    imports the batch-invariant Triton kernels (training/initialize.py → custom_layers/
    batch_invariant_kernels.py; used only with --batch-invariant-mode, on a GPU), which need ``triton.jit``
    and ``triton.language`` at import. A stand-in triton (``jit`` returns the function) is in
    ``sys.modules`` only while that one module imports, so nothing else (torch's own probes for triton,
    ``megatron.core.utils.HAVE_TRITON``) ever sees it."""
    import importlib
    import importlib.util
    import types

    kernels = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
    if importlib.util.find_spec("triton") is not None or importlib.util.find_spec(kernels) is None:
        return []
    triton, language = types.ModuleType("triton"), types.ModuleType("triton.language")
    triton.jit = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)
    triton.cdiv = lambda a, b: -(-a // b)
    language.__getattr__ = lambda name: object  # annotations such as tl.constexpr
    triton.language = language
    sys.modules.update({"triton": triton, "triton.language": language})
    try:
        importlib.import_module(kernels)
    finally:
        del sys.modules["triton"], sys.modules["triton.language"]
    return ["triton stand-in while importing batch_invariant_kernels"]


def preprocess_child(argv: list[str]) -> None:
    """Megatron-LM's tools/preprocess_data.py as ``__main__`` (cwd: the tree, on sys.path), after
    :func:`_triton_stand_in`; its 2 workers are forks, so they inherit the imported modules."""
    import runpy

    _triton_stand_in()
    sys.argv = ["tools/preprocess_data.py", *argv]
    runpy.run_path("tools/preprocess_data.py", run_name="__main__")


def _megatron_argv(job: dict) -> list[str]:
    m = job["model"]
    argv = ["--num-layers", m["num_layers"], "--hidden-size", m["hidden_size"],
            "--num-attention-heads", m["num_attention_heads"], "--seq-length", m["seq_length"],
            "--max-position-embeddings", m["max_position_embeddings"], "--micro-batch-size", 1,
            "--global-batch-size", 1, "--train-iters", 1, "--lr", 0.0,
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", job["vocab"],
            "--merge-file", job["merges"],
            "--load", job["load"], "--no-load-optim", "--no-load-rng", "--use-cpu-initialization",
            "--transformer-impl", "local", "--distributed-backend", "gloo", "--hidden-dropout", 0.0,
            "--attention-dropout", 0.0, "--no-masked-softmax-fusion", "--no-bias-dropout-fusion",
            "--no-gradient-accumulation-fusion", "--no-persist-layer-norm"]
    # core_v0.8.0 builds the legacy model unless told --use-mcore-models; later tags the reverse.
    argv.append("--use-legacy-models" if job["kind"] == "legacy" else "--use-mcore-models")
    # Slipway writes Megatron-LM's torch format (mp_rank_00/model_optim_rng.pt); from core_v0.10 the
    # default --ckpt-format is torch_dist, which the legacy model refuses outright.
    if "ckpt_format" in Path("megatron/training/arguments.py").read_text():  # not in core_v0.8.0
        argv += ["--ckpt-format", "torch"]
    return [str(a) for a in argv]


def _megatron_model(job: dict, patches: list[str]):
    """Megatron-LM's own set-up: its arguments, globals (tokenizer, padded vocab), model-parallel groups,
    ``get_model(model_provider)``; returns the model and the iteration ``load_checkpoint`` reports."""
    import pretrain_gpt
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType
    from megatron.training import checkpointing, training
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    sys.argv = ["pretrain_gpt.py", *_megatron_argv(job)]
    args = parse_args()
    if job["kind"] == "legacy" and not hasattr(args, "apply_layernorm_1p"):
        # 8. From core_v0.16 the parser is generated from TransformerConfig (Megatron-LM 639c08ab82), which
        # names the option layernorm_zero_centered_gamma; the legacy model (legacy/model/utils.py
        # get_norm) still reads args.apply_layernorm_1p. Same option, so the old name gets its value.
        args.apply_layernorm_1p = args.layernorm_zero_centered_gamma
        patches.append("args.apply_layernorm_1p ← layernorm_zero_centered_gamma")
    validate_args(args)
    set_global_variables(args)
    # initialize_megatron's _initialize_distributed skips the model-parallel groups without a GPU.
    dist.init_process_group("gloo", init_method=f"file://{job['store']}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    provider = pretrain_gpt.model_provider
    if hasattr(pretrain_gpt, "gpt_builder"):  # core_v0.16: what pretrain_gpt's __main__ passes to pretrain
        from functools import partial

        provider = partial(provider, pretrain_gpt.gpt_builder)
    model = training.get_model(provider, ModelType.encoder_or_decoder, wrap_with_ddp=False)
    iteration = checkpointing.load_checkpoint(model, None, None, strict=True)
    iteration = iteration[0] if isinstance(iteration, tuple) else iteration
    return model[0].eval(), iteration, type(model[0]).__module__ + "." + type(model[0]).__name__, torch


def child(job_file: str) -> int:
    """One Megatron-LM load + forward; writes its logits (.npy) and a JSON summary."""
    import numpy as np

    job = json.loads(Path(job_file).read_text())
    summary: dict = {"patches": _triton_stand_in() + _cpu_patches()}
    model, iteration, cls, torch = _megatron_model(job, summary["patches"])
    ids = torch.from_numpy(np.load(job["tokens"]))
    s = ids.shape[1]
    mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)  # True = masked (get_ltor_masks_and_position_ids)
    with torch.no_grad():
        logits = model(ids, torch.arange(s)[None].expand_as(ids), mask)
    np.save(job["out"], logits.float().numpy())
    summary.update(iteration=int(iteration), model_class=cls)
    Path(job["summary"]).write_text(json.dumps(summary))
    return 0


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


def slipway_checkpoints(work: Path, paths: dict, data_prefix: Path) -> dict[str, Path]:
    """format -> checkpoint folder of a 2-iteration run of Slipway's trainer (one process, CPU)."""
    out = {}
    for fmt in ("legacy", "mcore"):
        cfg = {"run_dir": str(work / f"run_{fmt}"), "model": dict(MODEL),
               "tokenizer": {"vocab_file": str(paths["vocab"]), "merge_file": str(paths["merges"])},
               "data": {"paths": [str(data_prefix)], "split": "100,0,0", "cache_dir": str(work / "cache")},
               "parallel": {"tp_size": 1, "pp_size": 1},
               "optim": {"lr": 1e-2, "min_lr": 1e-3, "warmup_iters": 1},
               "train": {"micro_batch_size": 2, "global_batch_size": 2, "iters": ITERS, "log_interval": 1,
                         "eval_interval": None, "deterministic": True, "device": "cpu"},
               "checkpoint": {"format": fmt}, "logging": {"wandb": {"mode": "disabled"}}, "kernels": "auto"}
        code = ("import json, sys; from trainer.config import RunConfig; from trainer.run import run; "
                "sys.exit(run(RunConfig.from_dict(json.loads(sys.argv[1]))).exit_code)")
        subprocess.run([sys.executable, "-c", code, json.dumps(cfg)], cwd=ROOT, check=True,
                       capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        out[fmt] = work / f"run_{fmt}" / "checkpoints"
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


def megatron_logits(tree: Path, ckpt: Path, kind: str, paths: dict, tokens: Path, work: Path) -> dict:
    """Megatron-LM from ``tree`` loads ``ckpt`` as a ``kind`` (legacy / mcore) model in a fresh process."""
    import numpy as np

    work.mkdir(parents=True, exist_ok=True)
    job = {"model": MODEL, "kind": kind, "load": str(ckpt), "vocab": str(paths["vocab"]),
           "merges": str(paths["merges"]), "tokens": str(tokens), "out": str(work / "logits.npy"),
           "summary": str(work / "summary.json"), "store": str(work / "store")}
    (work / "job.json").write_text(json.dumps(job))
    # bench/preprocess.py's import-time stand-ins: core_v0.8.0 imports pkg_resources (for its packaging).
    from bench.preprocess import _megatron_shims

    path = [str(tree), str(ROOT), str(_megatron_shims(work))]
    # CUDA_DEVICE_MAX_CONNECTIONS=1: what Megatron-LM's launch scripts export; validate_args insists on it.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", str(work / "job.json")], cwd=tree, env=env,
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
    cmd = [sys.executable, __file__, "--preprocess-child", "--input", str(paths["corpus"]),
           "--output-prefix", str(out / "stdlib"), "--json-keys", "content", "--tokenizer-type",
           "GPT2BPETokenizer", "--vocab-file", str(paths["vocab"]), "--merge-file", str(paths["merges"]),
           "--append-eod", "--workers", "2"]
    if "legacy_tokenizer" in (tree / "tools" / "preprocess_data.py").read_text():
        # core_v0.16's default tokenizer system builds GPT2BPETokenizer through HF AutoTokenizer("gpt2"),
        # which needs the Hub even with vocab and merges given; --legacy-tokenizer is Megatron's own
        # GPT-2 BPE from the two files, the tokenizer every earlier tag uses.
        cmd.append("--legacy-tokenizer")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT), str(_megatron_shims(work))])}
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


def tag_rows(tag: str, tree: Path, ctx: dict) -> list[tuple[str, ...]]:
    """(a) and (b) for one Megatron-LM tag: table rows (tag, part, what, result, verdict)."""
    rows = []
    for fmt, kind in (("legacy", "legacy"), ("mcore", "mcore")):
        r = megatron_logits(tree, ctx["ckpts"][fmt], kind, ctx["paths"], ctx["tokens"],
                            ctx["work"] / tag / f"load_{fmt}")
        what = f"load_checkpoint, checkpoint.format={fmt} → {kind} GPTModel"
        if "error" in r:
            rows.append((tag, "a", what, f"could not run: {r['error']}", "NOT RUN"))
            continue
        d = _diff(r["logits"], ctx["ours"][fmt])
        rows.append((tag, "a", what, f"max |Δlogit| {d:.2e} (iteration {r['iteration']}, {r['model_class']}, "
                     f"{r['seconds']} s)", _verdict(d)))
        seen = ctx["patches"].setdefault(tag, [])
        seen += [name for name in r["patches"] if name not in seen]
    r = megatron_preprocess(tree, ctx["paths"], ctx["work"] / tag / "preprocess", ctx["prefix"],
                            ctx["work"] / tag)
    what = "tools/preprocess_data.py vs trainer.data.preprocess (.bin/.idx bytes)"
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


def prepare(work: Path, vocab_size: int) -> dict:
    """Corpus, tokenizer, Slipway's .bin/.idx, the two checkpoints, fixed tokens and Slipway's logits."""
    import numpy as np
    import torch

    from bench.preprocess import prepare as corpus_and_tokenizer

    paths = corpus_and_tokenizer(work, vocab_size)
    prefix = slipway_preprocess(paths, work / "slipway")
    ckpts = slipway_checkpoints(work, paths, prefix)
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
             *(f"# {tag} runtime patches (bench/megatron_lm.py): {'; '.join(names)}"
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
    p.add_argument("--child", help=argparse.SUPPRESS)  # internal: one Megatron-LM run
    if argv is None and sys.argv[1:2] == ["--preprocess-child"]:  # internal: Megatron-LM's preprocess
        preprocess_child(sys.argv[2:])
        return 0
    a = p.parse_args(argv)
    if a.child:
        return child(a.child)
    meta = {**run_meta(), "versions": _versions()}
    with tempfile.TemporaryDirectory() as tmp:
        work = a.work or Path(tmp)
        ctx = prepare(work, a.vocab_size)
        print("bench/megatron_lm.py: transformers 4.27.4's converter", file=sys.stderr, flush=True)
        rows = hf_rows(ctx, a.transformers_wheel)
        for tag in a.tags:
            rows += _one_tag(a.repo, tag, ctx)
    tags = ", ".join(f"{t} = {c}" for t, c in ctx["commits"].items())
    meta["scale"] = max(float(v.abs().max()) for v in ctx["ours"].values())
    meta["megatron_lm"] = f"Megatron-LM from {a.repo}: {tags}"
    text = report(meta, rows, ctx["patches"], sys.argv[1:] if argv is None else argv)
    print(text, end="")
    if not a.no_save:
        RESULTS.write_text(text)
    return 0 if all(r[4] in ("ok", "n/a") for r in rows) else 1


def _one_tag(repo: Path, tag: str, ctx: dict) -> list[tuple[str, ...]]:
    """A tag's rows, or one row saying why it could not run (no mirror, no such tag, a crash here)."""
    try:
        tree = extract_tree(repo, tag, ctx["work"] / tag / "tree")
        ctx["commits"][tag] = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=10",
                                              f"{tag}^{{commit}}"], capture_output=True, text=True,
                                             check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as e:
        why = getattr(e, "stderr", b"") or str(e)
        why = why.decode(errors="replace") if isinstance(why, bytes) else why
        return [(tag, "a, b", f"git archive from {repo}", f"could not run: {why.strip()[:200]}", "NOT RUN")]
    print(f"bench/megatron_lm.py: {tag} ({ctx['commits'][tag]}): load_checkpoint ×2, preprocess_data.py",
          file=sys.stderr, flush=True)
    try:
        return tag_rows(tag, tree, ctx)
    except Exception:
        return [(tag, "a, b", "harness", f"could not run: {traceback.format_exc().splitlines()[-1]}",
                 "NOT RUN")]


if __name__ == "__main__":
    sys.exit(main())
