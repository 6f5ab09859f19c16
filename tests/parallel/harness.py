"""Multi-process harness for the parallel tests: real gloo process groups in forked workers, or NCCL
groups in spawned ones (one GPU per rank; tests/parallel/test_layout_parity_nccl.py).

Each *round* starts N workers; in a round, disjoint subsets of the workers run jobs side by side (e.g. a
tp=2 layout on ranks 0-1 and a pp=2 layout on ranks 2-3), each job building its own ParallelState over
its ranks, on its rank's device (:func:`rank_device`). Jobs write their results (on the CPU) with
torch.save; the test process compares.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import socket
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.config.model import ModelConfig
from trainer.parallel import (
    ParallelConfig,
    ParallelState,
    build_model,
    clip_grad_norm,
    eval_step,
    sharding,
    train_step,
)

CFG = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100,
                hidden_dropout=0.0, attention_dropout=0.0)
# The Llama options at the same size: GQA (2 KV groups for 4 heads, so tp=2 holds one group per rank),
# rope with a non-default base, RMSNorm, SwiGLU (ffn 64: the GLU split), no biases, an untied head.
LLAMA_CFG = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                        seq_length=16, vocab_size=100, hidden_dropout=0.0, attention_dropout=0.0,
                        position_embedding="rope", rotary_base=500000.0, normalization="rmsnorm",
                        activation="swiglu", ffn_hidden_size=64, add_bias_linear=False,
                        tie_word_embeddings=False)
MODELS = {"gpt": CFG, "llama": LLAMA_CFG}
KERNELS = "csrc"  # the fused CPU kernels: layouts must agree with them too
SEED, STEPS, MICRO_BATCH, GLOBAL_BATCH = 1234, 20, 2, 8
LR, MAX_NORM = 3e-3, 1.0
# A layout's losses, gradient norms and eval loss against the single-process run's, relative: fp32
# reduction-order noise over STEPS steps (tensor-parallel all-reduces and DP averaging sum in another
# order than one device's matmuls do), which never exceeds it in these runs.
LOSS_RTOL = 1e-5
# (tp, pp, dp, sequence_parallel): every layout the parity tests train, on gloo and on NCCL.
LAYOUTS = [(2, 1, 1, False), (1, 2, 1, False), (1, 4, 1, False), (2, 2, 1, False), (1, 1, 2, False),
           (2, 1, 2, False), (1, 2, 2, False), (2, 1, 1, True), (2, 2, 1, True), (2, 1, 2, True)]

Job = tuple[list[int], Callable[..., None], tuple]  # (ranks, fn(ranks, *args), args)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, jobs: list[Job], errdir: str, backend: str = "gloo") -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)  # one GPU per rank: NCCL refuses two ranks on one device
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        for ranks, fn, args in jobs:
            if rank in ranks:
                fn(ranks, *args)
    except BaseException:
        Path(errdir, f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_rounds(world: int, rounds: list[list[Job]], outdir: Path, backend: str = "gloo",
               start_method: str = "fork") -> None:
    """Run each round's jobs in ``world`` fresh workers of ``backend``; a worker's traceback fails us.

    A fresh world per round: a process group's name (and rendezvous keys in the store) is its rank set,
    so the same ranks cannot form a new group in the same world after the old one is destroyed. NCCL
    needs ``start_method="spawn"``: a forked child cannot use CUDA once the parent has.
    """
    for jobs in rounds:
        try:
            mp.start_processes(_worker, args=(world, free_port(), jobs, str(outdir), backend), nprocs=world,
                               start_method=start_method)
        except Exception as exc:
            errors = "\n".join(p.read_text() for p in sorted(outdir.glob("rank*.err")))
            raise AssertionError(f"worker failed:\n{errors}") from exc


def position(ranks: list[int]) -> int:
    return ranks.index(dist.get_rank()) if dist.is_initialized() else 0


def rank_device() -> torch.device:
    """This worker's device: its GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---- the training run every layout performs -------------------------------------------------------

def global_batch(step: int) -> dict[str, torch.Tensor]:
    """The step's global batch: learnable sequences (x → 7x + 3 mod V from a random start, so the loss
    falls within 20 steps) and a loss mask with some zeros."""
    g = torch.Generator().manual_seed(1000 + step)
    seq = [torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH,), generator=g)]
    for _ in range(CFG.seq_length):
        seq.append((7 * seq[-1] + 3) % CFG.vocab_size)
    seq = torch.stack(seq, dim=1)
    mask = (torch.rand(GLOBAL_BATCH, CFG.seq_length, generator=g) > 0.1).float()
    return {"tokens": seq[:, :-1], "labels": seq[:, 1:], "loss_mask": mask}


def microbatches(step: int, dp_rank: int, dp_size: int) -> list[dict[str, torch.Tensor]]:
    """Megatron's sampler order: micro-step j takes micro_batch·dp samples, DP rank r its slice."""
    batch, out = global_batch(step), []
    for j in range(GLOBAL_BATCH // (MICRO_BATCH * dp_size)):
        start = (j * dp_size + dp_rank) * MICRO_BATCH
        out.append({k: v[start: start + MICRO_BATCH] for k, v in batch.items()})
    return out


def adamw_step(params: list[torch.nn.Parameter], state: dict, step: int, lr: float = LR) -> None:
    """A plain AdamW update (β = 0.9, 0.95; eps 1e-8; weight decay 0.01)."""
    b1, b2, eps, wd = 0.9, 0.95, 1e-8, 0.01
    with torch.no_grad():
        for p in params:
            m, v = state.setdefault(id(p), (torch.zeros_like(p), torch.zeros_like(p)))
            m.mul_(b1).add_(p.grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            m_hat, v_hat = m / (1 - b1 ** (step + 1)), v / (1 - b2 ** (step + 1))
            p.mul_(1 - lr * wd).addcdiv_(m_hat, v_hat.sqrt().add_(eps), value=-lr)


def snapshot(model, what: str) -> dict[str, torch.Tensor]:
    """This rank's parameters or gradients by global name, copied to the CPU (records of GPU ranks are
    compared in the test process, whose device is not theirs)."""
    out = {}
    for name, p in model.named_parameters():
        t = p if what == "params" else p.grad
        out[model.global_name(name)] = t.detach().to("cpu", copy=True)
    return out


def train_and_record(model, steps: int = STEPS) -> dict:
    ps = model.pstate
    rec = {"coords": (ps.tp_rank, ps.pp_rank, ps.dp_rank), "losses": [], "norms": [], "overlap": [],
           "device": ps.device.type, "backend": dist.get_backend() if dist.is_initialized() else None,
           "dims": {model.global_name(n): d for n, d in model.partition_dims.items()},
           "kinds": {model.global_name(n): sharding.kind(n, model.chunks[0].cfg.activation == "swiglu")
                     for n in model.partition_dims},
           "init": snapshot(model, "params"), "n_buckets": len(model.grads.buckets)}
    state: dict = {}
    for step in range(steps):
        loss = train_step(model, microbatches(step, ps.dp_rank, ps.dp_size))
        rec["overlap"].append(model.grads.launched_in_backward)
        if step in (0, steps - 1):
            rec[f"grads{step}"] = snapshot(model, "grads")
        rec["losses"].append(loss.item())
        rec["norms"].append(clip_grad_norm(model, MAX_NORM))
        adamw_step(model.parameters(), state, step)
    rec["eval"] = eval_step(model, microbatches(steps, ps.dp_rank, ps.dp_size)).item()
    return rec


def parity_job(ranks: list[int], tp: int, pp: int, sp: bool, schedule: str, outdir: str, vp: int = 1,
               num_layers: int | None = None, model: str = "gpt") -> None:
    """Train one layout of ``MODELS[model]`` over ``ranks`` (``vp`` model chunks per stage, a
    ``num_layers`` GPT; None: the model's own) and save this rank's record."""
    pstate = ParallelState.build(tp, pp, ranks, device=rank_device())
    pcfg = ParallelConfig(tp_size=tp, pp_size=pp, virtual_pp_size=vp, sequence_parallel=sp,
                          schedule=schedule, bucket_size_mb=0.01)
    cfg = dataclasses.replace(MODELS[model], num_layers=num_layers or MODELS[model].num_layers)
    rec = train_and_record(build_model(cfg, pcfg, pstate, SEED, kernels=KERNELS))
    tag = layout_tag(tp, pp, len(ranks) // (tp * pp), sp, vp, cfg.num_layers)
    torch.save(rec, os.path.join(outdir, f"{tag}.{position(ranks)}.pt"))
    pstate.destroy()


def layout_tag(tp: int, pp: int, dp: int, sp: bool, vp: int = 1, num_layers: int = CFG.num_layers) -> str:
    return (f"tp{tp}_pp{pp}_dp{dp}" + ("_sp" if sp else "") + (f"_v{vp}" if vp > 1 else "")
            + (f"_L{num_layers}" if num_layers != CFG.num_layers else ""))


def reference_record(num_layers: int | None = None, model: str = "gpt", device: str = "cpu") -> dict:
    """The single-process run on ``device``, with no torch.distributed at all (one thread, like the
    workers)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = dataclasses.replace(MODELS[model], num_layers=num_layers or MODELS[model].num_layers)
        single = build_model(cfg, ParallelConfig(), ParallelState.single(device), SEED, kernels=KERNELS)
        return train_and_record(single)
    finally:
        torch.set_num_threads(threads)


def assemble(records: list[dict], key: str) -> dict[str, torch.Tensor]:
    """Full tensors from the shards of DP replica 0 (checking that replicas agree with it)."""
    by_name: dict[str, dict[int, torch.Tensor]] = {}
    for rec in records:
        tp_rank, _, dp_rank = rec["coords"]
        for name, t in rec[key].items():
            if dp_rank == 0:
                by_name.setdefault(name, {})[tp_rank] = t
    for rec in records:  # replicas (other DP ranks; other TP ranks for replicated tensors) must agree
        tp_rank, _, dp_rank = rec["coords"]
        for name, t in rec[key].items():
            ref = by_name[name][tp_rank if rec["dims"][name] is not None else 0]
            torch.testing.assert_close(t, ref, rtol=1e-6, atol=1e-9, msg=f"{key} {name} replica differs")
    kinds = {n: k for rec in records for n, k in rec["kinds"].items()}  # the GLU split is not a plain cat
    return {name: sharding.merge_tp([shards[i] for i in sorted(shards)], kinds[name])
            for name, shards in by_name.items()}


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12) if math.isfinite(a) else math.inf


EMB, HEAD = "embedding.word_embeddings.weight", "word_embeddings_for_head.weight"


def params_close(full: dict, ref: dict, what: str, rtol: float, atol: float) -> None:
    """Compare assembled tensors with the reference; the head's copy of the tied embedding included."""
    assert set(full) - {HEAD} == set(ref), f"{what}: parameter sets differ"
    vocab = CFG.vocab_size
    for name, t in full.items():
        r = ref[EMB if name == HEAD else name]
        if name in (EMB, HEAD):
            assert t[vocab:].abs().max() == 0, f"{what}: padded vocabulary rows of {name} are not zero"
            t, r = t[:vocab], r[:vocab]
        torch.testing.assert_close(t, r, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{what} {n}: {m}")


def assert_parity(records: list[dict], ref: dict, world: int, pp: int) -> float:
    """A layout's records against the single-process run (losses, grad norms, eval within LOSS_RTOL;
    initial weights exact; gradients close); returns the largest relative loss/norm difference."""
    assert len(records) == world
    last = records[[r["coords"][1] for r in records].index(pp - 1)]
    worst = 0.0
    for i, (loss, ref_loss) in enumerate(zip(last["losses"], ref["losses"], strict=True)):
        worst = max(worst, rel_diff(loss, ref_loss))
        assert rel_diff(loss, ref_loss) < LOSS_RTOL, f"step {i}: loss {loss} vs single-process {ref_loss}"
    assert all(r["losses"] == last["losses"] for r in records), "ranks report different losses"
    for i, (norm, ref_norm) in enumerate(zip(last["norms"], ref["norms"], strict=True)):
        worst = max(worst, rel_diff(norm, ref_norm))
        assert rel_diff(norm, ref_norm) < LOSS_RTOL, f"step {i}: grad norm {norm} vs {ref_norm}"
    assert rel_diff(last["eval"], ref["eval"]) < LOSS_RTOL
    params_close(assemble(records, "init"), ref["init"], "initial weights", 0, 0)
    params_close(assemble(records, "grads0"), ref["grads0"], "step-0 grads", 1e-5, 1e-7)
    params_close(assemble(records, f"grads{STEPS - 1}"), ref[f"grads{STEPS - 1}"], "last grads", 1e-3, 1e-6)
    return worst
