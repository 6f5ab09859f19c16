"""The Slipway runs and the Megatron jobs of the model checks (test_model: GPT-2 both ways and torch_dist;
test_llama: the Llama options, bf16 weights, the refused options), in one place so that conftest.py trains
every Slipway run in one spawn per tp and runs every Megatron job of a version in one subprocess (an
interpreter with megatron-core takes 5-8 s to start on CI's machine; once per version, not per module).

Megatron's outputs of the GPT jobs go to ``<out>/gpt/``, of the Llama jobs to ``<out>/llama/``.
"""

from __future__ import annotations

from pathlib import Path

from packaging.version import Version

from tests.mcore.versions import EXPORT_FORMAT
from tests.train.harness import run_cfg, tiny_config

ITERS = 2
FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "megatron"
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
# Megatron-LM's args for a Llama-style model (on top of the genuine fixture's): what
# --position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --swiglu
# --group-query-attention --num-query-groups 2 --disable-bias-linear
# --untie-embeddings-and-output-weights write.
MEGATRON_LLAMA = {"position_embedding_type": "rope", "use_rotary_position_embeddings": True,
                  "add_position_embedding": False, "rotary_base": 500000, "normalization": "RMSNorm",
                  "swiglu": True, "ffn_hidden_size": 128, "group_query_attention": True,
                  "num_query_groups": 2, "add_bias_linear": False, "add_qkv_bias": False,
                  "untie_embeddings_and_output_weights": True,
                  "vocab_file": str(TOKENIZER / "vocab.json"), "merge_file": str(TOKENIZER / "merges.txt")}
# Options Slipway refuses, each as Megatron-LM's args record it, on the Llama model above (tp 1).
REFUSED = {"num_experts": {"num_experts": 2, "moe_router_topk": 2},
           "rotary_interleaved": {"rotary_interleaved": True},
           "qk_layernorm": {"qk_layernorm": True},
           "add_qkv_bias": {"add_qkv_bias": True}}


def train(rank: int, *cfgs: dict) -> None:
    for cfg in cfgs:
        assert run_cfg(cfg).exit_code == 0


def run_configs(root: Path, data: str) -> dict[str, tuple[int, dict]]:
    """name -> (tp, config) of every Slipway run the model checks read; the run lives in ``root/name``.
    GPT-2 ``mcore{tp}`` (Megatron-core names, torch format) and ``dist{tp}`` (checkpoint.format=
    torch_dist; deterministic, so the same weights); the Llama runs of LLAMA_RUNS."""
    runs = {}
    for tp in (1, 2):
        for name, fmt in ((f"mcore{tp}", "mcore"), (f"dist{tp}", "torch_dist")):
            runs[name] = (tp, tiny_config(
                str(root / name), data, parallel={"tp_size": tp, "pp_size": 1},
                model={"hidden_dropout": 0.0, "attention_dropout": 0.0},
                train={"micro_batch_size": 2, "global_batch_size": 2, "iters": ITERS, "eval_interval": None},
                checkpoint={"format": fmt}, run_id=f"{fmt}-tp{tp}"))
    for name, (tp, precision) in LLAMA_RUNS.items():
        runs[name] = (tp, tiny_config(
            str(root / name), data, parallel={"tp_size": tp, "pp_size": 1}, model=LLAMA,
            # no warm-up: the 2 steps move the norms off 1 by ~1e-2, so a swapped or dropped norm shows
            # far above 1e-5
            optim={"distributed": precision == "bf16", "warmup_iters": 0},
            train={"micro_batch_size": 2, "global_batch_size": 2, "iters": ITERS, "eval_interval": None,
                   "precision": precision},
            checkpoint={"format": "mcore"}, run_id=f"mcore-{name}"))
    return runs


def _shards(iter_dir: Path, tp: int) -> list[str]:
    return [str(iter_dir / f"mp_rank_{r:02d}" / "model_optim_rng.pt") for r in range(tp)]


def gpt_export_args(version: str) -> dict:
    args = {"vocab_file": str(TOKENIZER / "vocab.json"), "merge_file": str(TOKENIZER / "merges.txt"),
            "tensor_model_parallel_size": 2}
    if Version(version) >= Version("0.10.0"):
        args["add_qkv_bias"] = True  # validate_args: add_qkv_bias = True whenever add_bias_linear
    return args


def gpt_jobs(version: str, out: Path, ids: Path, runs: dict[str, Path]) -> list[dict]:
    """GPTModel loads the GPT-2 runs at tp 1 and 2 (``in_tp{tp}``), the torch_dist runs crosswise
    (``dist_s{saved}_m{megatron}``), and exports its own weights at tp 2 (``export``)."""
    jobs = [{"tp": tp, "tokens": str(ids), "out": str(out / f"in_tp{tp}.npy"),
             "shard_files": _shards(runs[f"mcore{tp}"], tp)} for tp in (1, 2)]
    jobs += [{"tp": mtp, "tokens": str(ids), "out": str(out / f"dist_s{stp}_m{mtp}.npy"),
              "dist_dir": str(runs[f"dist{stp}"])} for stp, mtp in DIST_LAYOUTS]
    jobs.append({"tp": 2, "tokens": str(ids), "out": str(out / "export.npy"), "dir": str(out / "export"),
                 "iteration": 5, "args": gpt_export_args(version), "args_from": str(ARGS_FROM),
                 "format": EXPORT_FORMAT.get(version, "torch_dist")})
    return jobs


def _llama_export(out: Path, ids: Path, name: str, version: str, tp: int, extra: dict,
                  forward: bool = True, fmt: str | None = None) -> dict:
    job = {"tp": tp, "dir": str(out / name), "iteration": 5, "args_from": str(ARGS_FROM),
           "format": fmt or EXPORT_FORMAT.get(version, "torch_dist"),
           "args": {**MEGATRON_LLAMA, "tensor_model_parallel_size": tp, **extra}}
    if forward:
        job.update(tokens=str(ids), out=str(out / f"{name}.npy"))
    return job


def llama_jobs(version: str, out: Path, ids: Path, runs: dict[str, Path]) -> list[dict]:
    """GPTModel loads the Llama runs (``in_{tp1,tp2,bf16}``), exports its own Llama weights in fp32 and
    --bf16 (``export``, ``export_bf16``), and saves one model per refused option (``refused_{option}``)."""
    jobs = [{"tp": tp, "tokens": str(ids), "out": str(out / f"in_{name.removeprefix('llama_')}.npy"),
             "shard_files": _shards(runs[name], tp)} for name, (tp, _) in LLAMA_RUNS.items()]
    jobs += [_llama_export(out, ids, "export", version, 2, {}),
             _llama_export(out, ids, "export_bf16", version, 2, {"bf16": True})]
    # A torch_dist save takes 3-6 s on this CPU: the MoE model goes in the version's default format (the
    # refusal must come before torch_dist's names are read), the others in --ckpt-format torch.
    jobs += [_llama_export(out, ids, f"refused_{opt}", version, 1, extra, forward=False,
                           fmt=None if opt == "num_experts" else "torch") for opt, extra in REFUSED.items()]
    return jobs
