"""Training throughput on CPU: Slipway's training step versus transformers' GPT2LMHeadModel with
``torch.optim.AdamW``, same shape, same batches, measured in this one run.

Slipway runs its real step (``trainer.run.loop.step``: the parallel engine's train_step with gradient
buffers, unscale, global-norm clipping, the optimizer chosen by ``optim.impl=auto`` — the csrc multi-tensor
AdamW on CPU — and the LR scheduler) on the model ``trainer.run.entry.build_components`` builds with
``kernels=auto`` (csrc fused bias-GeLU, bias-dropout-add, LayerNorm, cross-entropy). Two baselines, the
textbook loop ``model(input_ids, labels).loss.backward()``, ``clip_grad_norm_(1.0)``, ``AdamW.step()``,
``zero_grad()`` on the same ``GPT2LMHeadModel`` (same initial weights, same batches), differing only in the
optimizer: ``torch.optim.AdamW(fused=True)`` (the strongest stock CPU AdamW: one fused kernel per
parameter group) and ``torch.optim.AdamW(foreach=False)`` (the per-tensor for-loop, torch's default for
CPU tensors). All train with dropout 0.1, fp32; steps alternate between the three so that all see the
same machine load. Reported: median tokens/s by wall clock and by process CPU time, and the ratios of
Slipway to each baseline; the verdict is against the fused one.

    python bench/train.py                       # 6 layers, 384 hidden, seq 256, vocab 32768
    python bench/train.py --steps 6 --micro-batch 4 --threads 2
    python bench/train.py --threads 1 --out bench/results/train_1thread.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.meta import load, run_meta  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "train.json"


def slipway_stepper(a: argparse.Namespace):
    """A function running one Slipway training step on a [b, s+1] token batch; returns the loss."""
    from trainer.config import RunConfig
    from trainer.parallel import ParallelState
    from trainer.run.entry import build_components
    from trainer.run.loop import Loop, step

    cfg = RunConfig.from_dict({
        "model": {"num_layers": a.layers, "hidden_size": a.hidden, "num_attention_heads": a.heads,
                  "seq_length": a.seq, "vocab_size": a.vocab},
        "train": {"micro_batch_size": a.micro_batch, "global_batch_size": a.micro_batch, "iters": 1000,
                  "device": "cpu"},
        "optim": {"lr": 1e-4, "weight_decay": 0.1}, "kernels": "auto", "run_dir": "/tmp/slipway-bench"})
    c = build_components(cfg, ParallelState.single())
    loop = Loop(model=c.model, optimizer=c.parts.optimizer, scheduler=c.parts.scheduler,
                scaler=c.parts.scaler, precision="fp32", clip_grad=1.0, global_batch_size=a.micro_batch,
                num_microbatches=1,
                train_iters=1000, train_data=None, valid_data=None, save=lambda s: None, wandb=None,
                cadence={}, throughput={})
    return lambda tokens: step(loop, [{"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}]).loss


def hf_stepper(a: argparse.Namespace, fused: bool):
    """transformers' GPT-2 and torch's AdamW, fused (one kernel per group) or the per-tensor for-loop."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=a.layers, n_embd=a.hidden, n_head=a.heads, n_positions=a.seq,
                        vocab_size=a.vocab, bos_token_id=a.vocab - 1, eos_token_id=a.vocab - 1,
                        attn_implementation="sdpa")
    torch.manual_seed(0)  # both baselines start from the same weights
    model = GPT2LMHeadModel(config).train()
    impl = {"fused": True} if fused else {"foreach": False}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
                            **impl)

    def one(tokens: torch.Tensor) -> float:
        inputs = tokens[:, :-1]
        loss = model(input_ids=inputs, labels=inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return one


def timed(fn, tokens: torch.Tensor) -> tuple[float, float, float]:
    w, c = time.perf_counter(), time.process_time()
    loss = fn(tokens)
    return time.perf_counter() - w, time.process_time() - c, loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=8, help="timed steps per implementation")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", type=Path, default=RESULTS, help="results file (default: results/train.json)")
    a = p.parse_args()
    meta = run_meta()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    steppers = {"slipway": slipway_stepper(a), "hf_fused_adamw": hf_stepper(a, fused=True),
                "hf_forloop_adamw": hf_stepper(a, fused=False)}
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, a.vocab, (a.micro_batch, a.seq + 1), generator=g)
               for _ in range(a.warmup + a.steps)]
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in steppers}
    losses: dict[str, list[float]] = {k: [] for k in steppers}
    for i, tokens in enumerate(batches):  # alternate: both see the same load
        for name, fn in steppers.items():
            wall, cpu, loss = timed(fn, tokens)
            losses[name].append(loss)
            if i >= a.warmup:
                times[name].append((wall, cpu))
    tokens_per_step = a.micro_batch * a.seq
    out = {**meta, "cpus": os.cpu_count(), "threads": a.threads, "torch": torch.__version__,
           "shape": {k: getattr(a, k) for k in ("layers", "hidden", "heads", "seq", "vocab", "micro_batch")},
           "steps": a.steps}
    for name in steppers:
        wall = statistics.median(t[0] for t in times[name])
        cpu = statistics.median(t[1] for t in times[name])
        out[name] = {"tokens_per_s_wall": tokens_per_step / wall, "tokens_per_s_cpu": tokens_per_step / cpu,
                     "ms_per_step_wall": wall * 1e3, "first_loss": losses[name][0],
                     "last_loss": losses[name][-1]}
    for base in ("hf_fused_adamw", "hf_forloop_adamw"):
        for clock in ("wall", "cpu"):
            out[f"ratio_{clock}_vs_{base}"] = (out["slipway"][f"tokens_per_s_{clock}"]
                                               / out[base][f"tokens_per_s_{clock}"])
    out["load_after"] = load()
    for name in steppers:
        r = out[name]
        sys.stdout.write(f"{name:17s} {r['tokens_per_s_wall']:9.1f} tokens/s wall  "
                         f"{r['tokens_per_s_cpu']:9.1f} tokens/s CPU  {r['ms_per_step_wall']:8.1f} ms/step  "
                         f"loss {r['first_loss']:.3f} -> "
                         f"{r['last_loss']:.3f}\n")
    for base in ("hf_fused_adamw", "hf_forloop_adamw"):
        sys.stdout.write(f"Slipway / {base}: {out[f'ratio_wall_vs_{base}']:.2f}x (wall), "
                         f"{out[f'ratio_cpu_vs_{base}']:.2f}x (CPU time)\n")
    sys.stdout.write(f"goal >= 1.2x the fused baseline; commit {out['commit']}, load {out['load_before']} -> "
                     f"{out['load_after']}\n")
    a.out.parent.mkdir(exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
