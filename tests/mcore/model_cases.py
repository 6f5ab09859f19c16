"""The Slipway runs and the Megatron jobs of the model checks (test_model: GPT-2 both ways and torch_dist;
test_llama: the Llama options, bf16 weights, the refused options), in one place so that conftest.py trains
every Slipway run in one spawn per tp and runs every Megatron job of a version in one subprocess (an
interpreter with megatron-core takes 5-8 s to start on CI's machine; once per version, not per module).

Megatron's outputs of the GPT jobs go to ``<out>/gpt/``, of the Llama jobs to ``<out>/llama/``.
"""

from __future__ import annotations

from pathlib import Path

from packaging.version import Version

from tests.fixtures import MEGATRON_FIXTURES as FIXTURES
from tests.mcore.versions import EXPORT_FORMAT, HAS_TRAINING
from tests.train.harness import VOCAB, run_cfg, tiny_config

ITERS = 2
TOKENIZER = FIXTURES / "tokenizer"
# The args a genuine core_v0.8.0 Megatron-LM wrote; the exports put theirs on top.
ARGS_FROM = FIXTURES / "mcore_torch_dist_tp2" / "iter_0000007" / "common.pt"

# GPT-2: (Slipway's tp at save, Megatron's at load) of the torch_dist check: crosswise, so that each load
# reassembles the tensors from another split (the harder case; ~2 s a load per version).
DIST_LAYOUTS = [(1, 2), (2, 1)]

# Llama options: rope (base 500000), RMSNorm, SwiGLU, grouped-query attention (2 KV groups for 4 heads),
# no linear biases, an untied output layer.
LLAMA = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
         "ffn_hidden_size": 64, "position_embedding": "rope", "rotary_base": 500000.0,
         "normalization": "rmsnorm", "activation": "swiglu", "add_bias_linear": False,
         "tie_word_embeddings": False, "hidden_dropout": 0.0, "attention_dropout": 0.0}
# Llama-style Slipway runs: name -> (tp, precision). bf16 with the distributed optimizer keeps bf16 weights.
LLAMA_RUNS = {"llama_tp1": (1, "fp32"), "llama_tp2": (2, "fp32"), "llama_bf16": (2, "bf16")}
# GPT-2 runs in 16 bits (distributed optimizer: the checkpoint holds the fp16 weights, as --fp16 saves).
LOW_RUNS = {"gpt_fp16": (2, "fp16")}
# Megatron-LM's args for a Llama-style model (on top of the genuine fixture's): what
# --position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --swiglu
# --group-query-attention --num-query-groups 2 --disable-bias-linear
# --untie-embeddings-and-output-weights write (add_position_embedding stays True: only
# --no-position-embedding clears it).
MEGATRON_LLAMA = {"position_embedding_type": "rope", "use_rotary_position_embeddings": False,
                  "add_position_embedding": True, "rotary_base": 500000, "normalization": "RMSNorm",
                  "swiglu": True, "ffn_hidden_size": 128, "group_query_attention": True,
                  "num_query_groups": 2, "add_bias_linear": False, "add_qkv_bias": False,
                  "untie_embeddings_and_output_weights": True,
                  "vocab_file": str(TOKENIZER / "vocab.json"), "merge_file": str(TOKENIZER / "merges.txt")}
# Options Slipway refuses, each as Megatron-LM's args record it, on the Llama model above (tp 1), and the
# flags that give them to Megatron-LM's parser.
REFUSED = {"num_experts": {"num_experts": 2, "moe_router_topk": 2},
           "rotary_interleaved": {"rotary_interleaved": True},
           "qk_layernorm": {"qk_layernorm": True},
           "add_qkv_bias": {"add_qkv_bias": True}}
REFUSED_FLAGS = {"num_experts": ["--num-experts", "2", "--moe-router-topk", "2"],
                 "rotary_interleaved": ["--rotary-interleaved"], "qk_layernorm": ["--qk-layernorm"],
                 "add_qkv_bias": ["--add-qkv-bias"]}
# The exported models' shapes: the genuine fixture's (ARGS_FROM; its tokenizer, 1024 tokens).
EXPORT_GPT = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
              "max_position_embeddings": 64}
EXPORT_LLAMA = {**LLAMA, **EXPORT_GPT, "ffn_hidden_size": 128}
# 16-bit forwards round every matmul output, norm and residual sum: bf16 keeps 8 significant bits (a
# rounding moves a value by up to 2^-9 of it, one step is 2^-8), fp16 11 (2^-12, a step 2^-11 below 1).
# Two 16-bit forwards of the same weights that order their arithmetic differently (Megatron vs HF, or
# Megatron's 16-bit forward vs its fp32 twin) differ by a few steps of the largest logits: bf16 measured
# 2.5e-3 to 3.9e-3 at max |logit| 0.45-0.64 (about 1.5 steps of 2^-8 there), fp16 2.9e-4 to 4.9e-4 at
# 0.6 (about one step of 2^-11); the MATRIX lines print each. The bound is 8 steps at the largest logit:
# 2^-5 · max |logit| for bf16, 2^-8 for fp16. It guards the 16-bit arithmetic, not the weights: a
# swapped pair of lightly trained norms moved the logits by only 5e-3, which the exact (fp32 twin, 1e-5)
# checks catch and this one would not.
LOW_REL = {"bf16": 2.0 ** -5, "fp16": 2.0 ** -8}
GPT2 = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
# Megatron's uneven pipeline splits of 3 layers on 2 stages: 1 + 2 (--decoder-first-pipeline-num-layers 1)
# and 2 + 1 (--decoder-last-pipeline-num-layers 1). Each names a Slipway run, a Megatron save and a load.
UNEVEN = {"layers": 3, "pp": 2, "first": 1}
UNEVEN_SPLITS = {"uneven": {"first_stage_layers": 1}, "uneven_last": {"last_stage_layers": 1}}
FIXTURE_TOKENIZER = {"vocab_file": str(TOKENIZER / "vocab.json"), "merge_file": str(TOKENIZER / "merges.txt")}


def write_tokenizer(root: Path) -> dict:
    """A GPT-2 BPE tokenizer of VOCAB tokens (the runs' vocabulary; the last is <|endoftext|>) and no
    merges: the runs name it, so that Megatron-LM's load_checkpoint compares the vocabulary-dependent args
    (max_position_embeddings, make_vocab_size_divisible_by, padded_vocab_size, tokenizer_type: only with a
    --vocab-file) and pads the vocabulary from it as the runs do."""
    import json

    root.mkdir(parents=True, exist_ok=True)
    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"<|endoftext|>": VOCAB - 1}
    (root / "vocab.json").write_text(json.dumps(vocab))
    (root / "merges.txt").write_text("#version: 0.2\n")
    return {"vocab_file": str(root / "vocab.json"), "merge_file": str(root / "merges.txt")}


def train(rank: int, *cfgs: dict) -> None:
    for cfg in cfgs:
        assert run_cfg(cfg).exit_code == 0


def run_configs(root: Path, data: str) -> dict[str, tuple[int, dict]]:
    """name -> (world size, config) of every Slipway run the model checks read, in ``root/name``.
    GPT-2 ``mcore{tp}`` (Megatron-core names, torch format) and ``dist{tp}`` (checkpoint.format=
    torch_dist; deterministic, so the same weights), two of them written asynchronously (mcore2, dist1);
    the Llama runs of LLAMA_RUNS; LOW_RUNS; ``uneven``."""
    tokenizer = write_tokenizer(root / "tokenizer")
    runs = {}
    for tp in (1, 2):
        for name, fmt in ((f"mcore{tp}", "mcore"), (f"dist{tp}", "torch_dist")):
            runs[name] = (tp, tiny_config(
                str(root / name), data, parallel={"tp_size": tp, "pp_size": 1},
                model={"hidden_dropout": 0.0, "attention_dropout": 0.0},
                train={"micro_batch_size": 2, "global_batch_size": 2, "iters": ITERS, "eval_interval": None},
                # Megatron loads checkpoints of both save paths: mcore2 and dist1 written by the
                # background writer (checkpoint.async_save), mcore1 and dist2 synchronously.
                checkpoint={"format": fmt, "async_save": (tp == 2) == (fmt == "mcore")}, tokenizer=tokenizer,
                run_id=f"{fmt}-tp{tp}"))
    # Megatron's uneven splits in Slipway runs (3 layers as 1 + 2 and 2 + 1 on 2 stages; world 2: the tp 2
    # spawn).
    for name, split in UNEVEN_SPLITS.items():
        runs[name] = (2, tiny_config(
            str(root / name), data, parallel={"tp_size": 1, "pp_size": UNEVEN["pp"], **split},
            model={**GPT2, "num_layers": UNEVEN["layers"]},
            train={"micro_batch_size": 1, "global_batch_size": 2, "iters": ITERS, "eval_interval": None},
            checkpoint={"format": "mcore"}, tokenizer=tokenizer, run_id=f"mcore-{name}"))
    for name, (tp, precision) in {**LLAMA_RUNS, **LOW_RUNS}.items():
        model = LLAMA if name in LLAMA_RUNS else {"hidden_dropout": 0.0, "attention_dropout": 0.0}
        runs[name] = (tp, tiny_config(
            str(root / name), data, parallel={"tp_size": tp, "pp_size": 1}, model=model,
            # no warm-up: the 2 steps move the norms off 1 by ~1e-2, so a swapped or dropped norm shows
            # far above 1e-5
            optim={"distributed": precision != "fp32", "warmup_iters": 0},
            train={"micro_batch_size": 2, "global_batch_size": 2, "iters": ITERS, "eval_interval": None,
                   "precision": precision},
            checkpoint={"format": "mcore"}, tokenizer=tokenizer, run_id=f"mcore-{name}"))
    return runs


def _shards(iter_dir: Path, tp: int) -> list[str]:
    return [str(iter_dir / f"mp_rank_{r:02d}" / "model_optim_rng.pt") for r in range(tp)]


def run_tokenizer(runs: dict[str, Path]) -> dict:
    """The tokenizer files every run names (write_tokenizer, beside the runs)."""
    root = next(iter(runs.values())).parents[2] / "tokenizer"
    return {"vocab_file": str(root / "vocab.json"), "merge_file": str(root / "merges.txt")}


def gpt_export_args(version: str) -> dict:
    args = {"vocab_file": str(TOKENIZER / "vocab.json"), "merge_file": str(TOKENIZER / "merges.txt"),
            "tensor_model_parallel_size": 2}
    if Version(version) >= Version("0.10.0"):
        args["add_qkv_bias"] = True  # validate_args: add_qkv_bias = True whenever add_bias_linear
    return args


class Jobs:
    """One version's Megatron jobs into ``out`` (logits on ``ids``). With Megatron-LM's training side in
    the wheel (versions.HAS_TRAINING) every load is its ``load_checkpoint`` and every save its
    ``save_checkpoint``, with the args of its own parser (megatron_lm_argv); else GPTModel's
    ``load_state_dict``/``dist_checkpointing.load`` and ``megatron_gpt.export`` with a genuine fixture's
    args. The output names are the same either way."""

    def __init__(self, version: str, out: Path, ids: Path, runs: dict[str, Path]) -> None:
        self.version, self.out, self.ids, self.runs = version, out, ids, runs
        self.lm = version in HAS_TRAINING

    def _forward(self, name: str) -> dict:
        return {"tokens": str(self.ids), "out": str(self.out / f"{name}.npy")}

    def load(self, name: str, run: str, tp: int, model: dict, precision: str = "fp32") -> dict:
        """Megatron reads the Slipway run ``run`` at ``tp`` (a torch_dist run at any tp)."""
        iter_dir = self.runs[run]
        dist = run.startswith("dist")
        if self.lm:
            argv = megatron_lm_argv(model, tp, run_tokenizer(self.runs), precision, model.get("pp", 1),
                                    model.get("first_stage_layers"), model.get("last_stage_layers"))
            return {"tp": tp, "pp": model.get("pp", 1),
                    "argv": [*argv, "--ckpt-format", "torch_dist" if dist else "torch"],
                    "load": str(iter_dir.parent), "args_out": str(self.out / f"{name}.json"),
                    "compare": sorted(vars(slipway_args(iter_dir))), **self._forward(name),
                    **({"common_probe": str(iter_dir)} if dist else {})}
        where = {"dist_dir": str(iter_dir)} if dist else {"shard_files": _shards(iter_dir, tp)}
        return {"tp": tp, **where, **self._forward(name)}

    def save(self, name: str, model: dict, tp: int, extra: dict, fmt: str | None = None,
             precision: str = "fp32", forward: bool = True, flags: tuple = ()) -> dict:
        """Megatron saves its own (seeded) ``model`` at ``tp`` into ``out/name`` in ``fmt`` (the
        version's default: torch_dist, or EXPORT_FORMAT)."""
        fmt = fmt or EXPORT_FORMAT.get(self.version, "torch_dist")
        job = {"tp": tp, "dir": str(self.out / name), "iteration": 5}
        job.update(self._forward(name) if forward else {})
        if self.lm:
            argv = megatron_lm_argv(model, tp, FIXTURE_TOKENIZER, precision, model.get("pp", 1),
                                    model.get("first_stage_layers"), model.get("last_stage_layers"))
            return {**job, "pp": model.get("pp", 1), "argv": [*argv, *flags, "--ckpt-format", fmt]}
        low = {"fp16": True} if precision == "fp16" else {"bf16": True} if precision == "bf16" else {}
        return {**job, "args_from": str(ARGS_FROM), "format": fmt, "args": {**extra, **low}}


def slipway_args(iter_dir: Path):
    from trainer.checkpoint.files import DIST_METADATA
    from trainer.convert.dist import read_common
    from trainer.convert.shard_io import load_shard

    if (iter_dir / DIST_METADATA).is_file():
        return read_common(iter_dir)["args"]
    return load_shard(min(iter_dir.glob("mp_rank_00*")) / "model_optim_rng.pt")["args"]


def gpt_jobs(version: str, out: Path, ids: Path, runs: dict[str, Path]) -> list[dict]:
    """Megatron loads the GPT-2 runs at tp 1 and 2 (``in_tp{tp}``), the torch_dist runs crosswise
    (``dist_s{saved}_m{megatron}``) and the fp16 run (``in_fp16``), and saves its own weights at tp 2
    (``export``; ``export_fp16`` under --fp16, in --ckpt-format torch: the format is the other export's).
    Megatron-LM (HAS_TRAINING) also saves and loads the uneven splits (``uneven``, ``in_uneven``;
    ``uneven_last``, ``in_uneven_last``)."""
    j = Jobs(version, out, ids, runs)
    jobs = [j.load(f"in_tp{tp}", f"mcore{tp}", tp, GPT2) for tp in (1, 2)]
    jobs += [j.load(f"dist_s{stp}_m{mtp}", f"dist{stp}", mtp, GPT2) for stp, mtp in DIST_LAYOUTS]
    jobs.append(j.load("in_fp16", "gpt_fp16", 2, GPT2, "fp16"))
    jobs.append(j.save("export", EXPORT_GPT, 2, gpt_export_args(version)))
    jobs.append(j.save("export_fp16", EXPORT_GPT, 2, gpt_export_args(version), "torch", "fp16"))
    for name, split in UNEVEN_SPLITS.items() if j.lm else ():  # Megatron-LM's splits both ways, pp 2
        split = {"num_layers": UNEVEN["layers"], "pp": UNEVEN["pp"], **split}
        jobs.append(j.save(name, {**EXPORT_GPT, **split}, 1, {}, "torch"))
        jobs.append(j.load(f"in_{name}", name, 1, {**GPT2, **split}))
    return jobs


def llama_jobs(version: str, out: Path, ids: Path, runs: dict[str, Path]) -> list[dict]:
    """Megatron loads the Llama runs (``in_{tp1,tp2,bf16}``), exports its own Llama weights in fp32 and
    --bf16 (``export``, ``export_bf16``), and saves one model per refused option (``refused_{option}``)."""
    j = Jobs(version, out, ids, runs)
    jobs = [j.load(f"in_{name.removeprefix('llama_')}", name, tp, LLAMA, precision)
            for name, (tp, precision) in LLAMA_RUNS.items()]
    extra = {**MEGATRON_LLAMA, "tensor_model_parallel_size": 2}
    jobs += [j.save("export", EXPORT_LLAMA, 2, extra),
             j.save("export_bf16", EXPORT_LLAMA, 2, extra, "torch" if j.lm else None, "bf16")]
    # A torch_dist save takes 3-6 s on this CPU: the MoE model goes in the version's default format (the
    # refusal must come before torch_dist's names are read), the others in --ckpt-format torch.
    for opt, values in REFUSED.items():
        args = {**MEGATRON_LLAMA, "tensor_model_parallel_size": 1, **values}
        fmt = None if opt == "num_experts" else "torch"
        jobs.append(j.save(f"refused_{opt}", EXPORT_LLAMA, 1, args, fmt, forward=False,
                           flags=REFUSED_FLAGS[opt]))
    return jobs


# tiny_config's model (tests/train/harness.py) under the runs' own settings.
_TINY = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16}


def megatron_lm_argv(model: dict, tp: int, tokenizer: dict, precision: str = "fp32", pp: int = 1,
                     first_stage_layers: int | None = None,
                     last_stage_layers: int | None = None) -> list[str]:
    """The Megatron-LM (pretrain_gpt.py) flags of the same model as a Slipway ``model`` section: what a
    user passes to load or continue it (the parser's defaults stand for Slipway's: learned positions,
    LayerNorm, GeLU, biases, tied head, norm epsilon 1e-5, make-vocab-size-divisible-by 128)."""
    m = {**_TINY, **model}
    argv = ["--num-layers", m["num_layers"], "--hidden-size", m["hidden_size"],
            "--num-attention-heads", m["num_attention_heads"], "--seq-length", m["seq_length"],
            "--max-position-embeddings", m.get("max_position_embeddings") or m["seq_length"],
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", tokenizer["vocab_file"],
            "--merge-file", tokenizer["merge_file"], "--tensor-model-parallel-size", tp]
    if m.get("ffn_hidden_size"):
        argv += ["--ffn-hidden-size", m["ffn_hidden_size"]]
    if m.get("position_embedding") == "rope":
        argv += ["--position-embedding-type", "rope", "--rotary-base", int(m.get("rotary_base", 10000))]
    if m.get("normalization") == "rmsnorm":
        argv += ["--normalization", "RMSNorm"]
    if m.get("activation") == "swiglu":
        argv.append("--swiglu")
    if m.get("num_query_groups") not in (None, m["num_attention_heads"]):
        argv += ["--group-query-attention", "--num-query-groups", m["num_query_groups"]]
    if not m.get("add_bias_linear", True):
        argv.append("--disable-bias-linear")
    if not m.get("tie_word_embeddings", True):
        argv.append("--untie-embeddings-and-output-weights")
    if precision != "fp32":
        argv.append(f"--{precision}")
    if pp > 1:
        argv += ["--pipeline-model-parallel-size", pp]
    if first_stage_layers is not None:
        argv += ["--decoder-first-pipeline-num-layers", first_stage_layers]
    if last_stage_layers is not None:
        argv += ["--decoder-last-pipeline-num-layers", last_stage_layers]
    return [str(a) for a in argv]
