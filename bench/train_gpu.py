"""CodeParrot-small training-step throughput on one GPU: Slipway's GPT with eager / csrc / apex kernels,
and transformers' GPT-2 of the same shape as the baseline, all measured in this one process.

    python bench/train_gpu.py [--modes eager,csrc,apex,hf] [--micro-batches 64,32,16,8] [--budget-s 240]

bf16 autocast with fp32 parameters (trainer/precision.py's design), seq 1024, random tokens. The best
micro-batch that fits is found once (largest first, with the first mode) and used for every mode (a mode
that runs out of memory retries at half). Reports tokens/s, model
TFLOP/s (Megatron's formula, performance.md) and MFU against --peak-tflops (H100/H200 bf16 dense: 989).
Optimizer per mode: eager → torch.optim.AdamW(foreach), csrc → trainer.ops.adamw.FusedAdamW,
apex → apex FusedAdam, hf → torch.optim.AdamW(fused).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYERS, HIDDEN, HEADS, VOCAB, SEQ = 12, 768, 12, 32768, 1024


def flops_per_step(batch: int, seq: int = SEQ) -> float:
    """Megatron's formula, the trainer's own definition: bench and training logs agree on TFLOP/s."""
    from trainer.formulas import flops_per_iteration, padded_vocab_size  # after the sys.path insert above

    return flops_per_iteration(batch, seq, LAYERS, HIDDEN, padded_vocab_size(VOCAB))


def build(mode: str):
    """(model, optimizer, step_fn(tokens) -> loss) for one mode, on CUDA."""
    if mode == "hf":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB, n_positions=SEQ,
                         bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
        model = GPT2LMHeadModel(cfg).cuda().train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        return model, opt, lambda tokens: model(input_ids=tokens, labels=tokens).loss
    from trainer.model.config import GPTConfig
    from trainer.model.gpt import build_gpt, masked_mean

    cfg = GPTConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, seq_length=SEQ,
                    vocab_size=VOCAB)
    model = build_gpt(cfg, seed=1234, device="cuda", kernels=mode).train()
    if mode == "csrc":
        from trainer.ops.adamw import FusedAdamW

        opt = FusedAdamW(model.parameters(), lr=1e-4)
    elif mode == "apex":
        from apex.optimizers import FusedAdam  # type: ignore[import-not-found]

        opt = FusedAdam(model.parameters(), lr=1e-4, adam_w_mode=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    return model, opt, lambda tokens: masked_mean(model(tokens, labels=tokens))


def train_step(step_fn, opt, tokens) -> torch.Tensor:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = step_fn(tokens)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def fits(mode: str, batch: int) -> bool:
    try:
        model, opt, step_fn = build(mode)
        train_step(step_fn, opt, torch.randint(0, VOCAB, (batch, SEQ), device="cuda"))
        torch.cuda.synchronize()
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        torch.cuda.empty_cache()


def measure(mode: str, batch: int, steps: int, warmup: int) -> dict:
    """Time `steps` training steps; a mode that runs out of memory at `batch` retries at half of it."""
    try:
        return _measure(mode, batch, steps, warmup)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        if batch == 1:
            raise
        return measure(mode, batch // 2, steps, warmup)


def _measure(mode: str, batch: int, steps: int, warmup: int) -> dict:
    model, opt, step_fn = build(mode)
    tokens = torch.randint(0, VOCAB, (batch, SEQ), device="cuda")
    for _ in range(warmup):
        train_step(step_fn, opt, tokens)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = train_step(step_fn, opt, tokens)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    names = getattr(getattr(model, "encoder", None), "layers", [None])[0]
    kernels = getattr(names, "kernels", None)
    del model, opt
    torch.cuda.empty_cache()
    return dict(mode=mode, batch=batch, step_s=dt, tokens_s=batch * SEQ / dt,
                tflops=flops_per_step(batch) / dt / 1e12, loss=float(loss.detach()),
                kernels=getattr(kernels, "names", {}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="eager,csrc,apex,hf")
    ap.add_argument("--micro-batches", default="64,48,32,16,8")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--budget-s", type=float, default=240.0, help="skip remaining modes past this wall time")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.stderr.write("train_gpu.py needs a CUDA GPU\n")
        return 1
    start = time.perf_counter()
    modes = [m for m in args.modes.split(",") if m]
    if "apex" in modes:
        try:
            import apex.optimizers  # type: ignore[import-not-found] # noqa: F401
        except Exception:  # noqa: BLE001
            sys.stdout.write("apex not importable: skipping mode apex\n")
            modes.remove("apex")
    probe = modes[0]  # eager first by default: its fp32 copy of the logits makes it the hungriest
    batch = next((b for b in map(int, args.micro_batches.split(",")) if fits(probe, b)), None)
    if batch is None:
        sys.stdout.write("no micro-batch fits\n")
        return 1
    sys.stdout.write(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  "
                     f"micro-batch {batch} x seq {SEQ}"
                     f"  ({flops_per_step(batch) / (batch * SEQ):.3g} FLOPs/token)\n")
    header = (f"{'mode':<8}{'batch':>6}{'step ms':>9}{'tokens/s':>11}{'TFLOP/s':>9}{'MFU':>7}{'loss':>8}"
              "  kernels\n")
    sys.stdout.write(header)
    results = []
    for mode in modes:
        if time.perf_counter() - start > args.budget_s:
            sys.stdout.write(f"{mode:<8} skipped: past the --budget-s of {args.budget_s:.0f} s\n")
            continue
        r = measure(mode, batch, args.steps, args.warmup)
        results.append(r)
        sys.stdout.write(f"{mode:<8}{r['batch']:>6}{r['step_s'] * 1e3:>9.1f}{r['tokens_s']:>11.0f}"
                         f"{r['tflops']:>9.1f}{100 * r['tflops'] / args.peak_tflops:>6.1f}%{r['loss']:>8.3f}"
                         f"  {r['kernels']}\n")
        sys.stdout.flush()
    base = {r["mode"]: r["tokens_s"] for r in results}
    for ref in ("eager", "hf"):
        if ref in base:
            ratios = ", ".join(f"{m} {v / base[ref]:.2f}x" for m, v in base.items() if m != ref)
            sys.stdout.write(f"throughput vs {ref}: {ratios}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
