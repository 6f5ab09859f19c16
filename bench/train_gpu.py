"""CodeParrot-small training-step throughput and MFU on one GPU: Slipway's GPT with eager / csrc / apex /
compile kernels, and transformers' GPT-2 of the same shape as the baseline, all measured in this process.

    python bench/train_gpu.py [--modes eager,csrc,apex,compile,hf] [--micro-batches 8,16,32,64]
    python bench/train_gpu.py --device cpu --model gpt_tiny --micro-batches 1,2 --steps 2   # rehearsal

The shape is hydra_conf/model/<--model>.yaml (the one the experiments use; dropout as there) with a
--vocab vocabulary (CodeParrot's 32768), bf16 autocast over fp32 parameters (trainer/optim/precision.py's
design), random tokens. The best micro-batch is found first: each of --micro-batches is timed for a few
steps with the probe mode (csrc when asked for, else the first mode) and the one with the most tokens/s
wins (sizes that run out of memory are skipped); every mode then runs at it (a mode that runs out of
memory retries at half). Reports step time, tokens/s, model TFLOP/s (Megatron's formula,
trainer.formulas) and MFU against the device's dense bf16 peak (the device table, trainer/devices.py:
H100/H200 989) or --peak-tflops, the peak memory, and throughput ratios against eager and against HF.

Optimizer per mode: eager → torch.optim.AdamW(foreach) (the unfused baseline), csrc → Slipway's
FusedAdamW (trainer.ops.adamw), apex → apex FusedAdam, compile and hf → torch.optim.AdamW(fused) (what
optim.impl=auto picks on CUDA without apex; kernels=compile leaves AdamW uncompiled).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

import torch
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from trainer.config.model import ModelConfig  # noqa: E402
from trainer.formulas import model_flops_per_iteration  # noqa: E402
from trainer.ops.dtypes import DTYPES  # noqa: E402
from trainer.run.metrics import detect_peak_tflops  # noqa: E402

SLIPWAY_MODES = ("eager", "csrc", "apex", "compile")


@dataclass(frozen=True)
class Bench:
    """What every measurement shares."""

    model: ModelConfig
    device: torch.device
    precision: str  # a train.precision value: autocast dtype of the forward
    steps: int
    warmup: int

    def flops(self, batch: int) -> float:
        """Megatron's formula, the trainer's own definition: bench and training logs agree on TFLOP/s."""
        return model_flops_per_iteration(self.model, batch, self.model.padded_vocab_size(1))


def model_config(name: str, vocab: int) -> ModelConfig:
    with open(os.path.join(REPO, "hydra_conf", "model", f"{name}.yaml"), encoding="utf-8") as f:
        return ModelConfig(**{**yaml.safe_load(f), "vocab_size": vocab})


def build(mode: str, b: Bench):
    """(model, optimizer, loss_fn(tokens) -> loss) for one mode on ``b.device``."""
    m = b.model
    if mode == "hf":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_layer=m.num_layers, n_embd=m.hidden_size, n_head=m.num_attention_heads,
                         vocab_size=m.vocab_size, n_positions=m.seq_length, resid_pdrop=m.hidden_dropout,
                         embd_pdrop=m.hidden_dropout, attn_pdrop=m.attention_dropout, bos_token_id=0,
                         eos_token_id=0, attn_implementation="sdpa")
        model = GPT2LMHeadModel(cfg).to(b.device).train()
        return model, _adamw(model, "torch_fused", b), lambda t: model(input_ids=t, labels=t).loss
    from trainer.model.gpt import build_gpt, masked_mean

    model = build_gpt(m, seed=1234, device=b.device, kernels=mode).train()
    impl = {"eager": "foreach", "csrc": "csrc", "apex": "apex", "compile": "torch_fused"}[mode]
    return model, _adamw(model, impl, b), lambda t: masked_mean(model(t, labels=t))


def _adamw(model: torch.nn.Module, impl: str, b: Bench) -> torch.optim.Optimizer:
    """torch_fused needs CUDA; on the CPU (rehearsal) foreach stands in for it."""
    params = list(model.parameters())
    if impl == "csrc":
        from trainer.ops.adamw import FusedAdamW

        return FusedAdamW(params, lr=1e-4)
    if impl == "apex":
        from apex.optimizers import FusedAdam  # type: ignore[import-not-found]

        return FusedAdam(params, lr=1e-4, adam_w_mode=True)
    fused = impl == "torch_fused" and b.device.type == "cuda"
    return torch.optim.AdamW(params, lr=1e-4, fused=fused or None, foreach=not fused)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError)


def time_steps(mode: str, batch: int, b: Bench) -> dict:
    """Build ``mode``, run ``b.warmup`` steps, then time ``b.steps``; returns the measurement."""
    model, opt, loss_fn = build(mode, b)
    tokens = torch.randint(0, b.model.vocab_size, (batch, b.model.seq_length), device=b.device)

    def step() -> torch.Tensor:
        with torch.autocast(b.device.type, dtype=DTYPES[b.precision]):
            loss = loss_fn(tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if b.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(b.warmup):
        step()
    _sync(b.device)
    t0 = time.perf_counter()
    for _ in range(b.steps):
        loss = step()
    _sync(b.device)
    dt = (time.perf_counter() - t0) / b.steps
    layer = getattr(getattr(model, "encoder", None), "layers", [None])[0]
    names = getattr(getattr(layer, "kernels", None), "names", {})
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if b.device.type == "cuda" else float("nan")
    model = opt = None  # noqa: F841 - drop the references so the memory can go back to the allocator
    _free(b.device)
    return dict(mode=mode, batch=batch, step_s=dt, tokens_s=batch * b.model.seq_length / dt,
                tflops=b.flops(batch) / dt / 1e12, loss=float(loss.detach()), peak_gib=peak_gib,
                kernels=_summary(names))


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _summary(names: dict) -> str:
    """{op: impl} as 'impl: op, op; impl: …' (the implementations actually chosen)."""
    by: dict[str, list[str]] = {}
    for op, impl in names.items():
        by.setdefault(impl, []).append(op)
    return "; ".join(f"{impl}: {', '.join(ops)}" for impl, ops in sorted(by.items()))


def measure(mode: str, batch: int, b: Bench) -> dict:
    """``time_steps``; a mode that runs out of memory at ``batch`` retries at half of it."""
    try:
        return time_steps(mode, batch, b)
    except Exception as e:
        if not _oom(e) or batch == 1:
            raise
    _free(b.device)
    return measure(mode, batch // 2, b)


def best_micro_batch(mode: str, candidates: list[int], b: Bench) -> tuple[int | None, list[str]]:
    """The candidate with the most tokens/s for ``mode`` (a few steps each), and one line per candidate."""
    short = Bench(b.model, b.device, b.precision, steps=max(2, b.steps // 2), warmup=min(2, b.warmup))
    best, lines = None, []
    for batch in candidates:
        try:
            r = time_steps(mode, batch, short)
        except Exception as e:
            if not _oom(e):
                raise
            _free(b.device)
            lines.append(f"  micro-batch {batch:>4}: out of memory")
            continue
        lines.append(f"  micro-batch {batch:>4}: {r['tokens_s']:>10.0f} tokens/s  {r['tflops']:>6.1f} TFLOP/s"
                     f"  peak {r['peak_gib']:.1f} GiB")
        if best is None or r["tokens_s"] > best[1]:
            best = (batch, r["tokens_s"])
    return (best[0] if best else None), lines


def row(r: dict, peak: float | None) -> str:
    mfu = f"{100 * r['tflops'] / peak:>6.1f}%" if peak else f"{'-':>7}"
    return (f"{r['mode']:<8}{r['batch']:>6}{r['step_s'] * 1e3:>9.1f}{r['tokens_s']:>11.0f}{r['tflops']:>9.1f}"
            f"{mfu}{r['loss']:>8.3f}{r['peak_gib']:>8.1f}  {r['kernels']}")


def available_modes(requested: list[str], device: torch.device) -> tuple[list[str], list[str]]:
    """(modes to run, lines saying which were dropped and why): apex needs CUDA and an importable apex."""
    modes, notes = [], []
    for mode in requested:
        if mode not in SLIPWAY_MODES + ("hf",):
            raise SystemExit(f"unknown mode {mode!r}: choose from {', '.join(SLIPWAY_MODES + ('hf',))}")
        if mode == "apex":
            try:
                import apex.optimizers  # type: ignore[import-not-found] # noqa: F401
            except Exception as e:  # noqa: BLE001 - absent, or built without its CUDA extensions
                notes.append(f"apex not importable ({type(e).__name__}): mode apex skipped")
                continue
        modes.append(mode)
    return modes, notes


def ratios(results: list[dict]) -> list[str]:
    base = {r["mode"]: r["tokens_s"] for r in results}
    return [f"throughput vs {ref}: " + ", ".join(f"{m} {v / base[ref]:.2f}x" for m, v in base.items()
                                                 if m != ref)
            for ref in ("eager", "hf") if ref in base and len(base) > 1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="eager,csrc,apex,compile,hf")
    ap.add_argument("--micro-batches", default="8,16,32,64", help="candidates for the best micro-batch")
    ap.add_argument("--model", default="codeparrot_small", help="hydra_conf/model/<name>.yaml")
    ap.add_argument("--vocab", type=int, default=32768, help="CodeParrot's tokenizer: 32768")
    ap.add_argument("--precision", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: rehearse the script")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=None, help="default: the device's, by name")
    ap.add_argument("--budget-s", type=float, default=240.0, help="skip remaining modes past this wall time")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.stderr.write("train_gpu.py: no CUDA device (use --device cpu to rehearse)\n")
        return 1
    start, device = time.perf_counter(), torch.device(args.device)
    b = Bench(model_config(args.model, args.vocab), device, args.precision, args.steps, args.warmup)
    modes, notes = available_modes([m for m in args.modes.split(",") if m], device)
    for note in notes:
        print(note)
    peak = detect_peak_tflops(device, args.peak_tflops)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (rehearsal: no MFU)"
    probe = "csrc" if "csrc" in modes else modes[0]
    batch, lines = best_micro_batch(probe, [int(x) for x in args.micro_batches.split(",")], b)
    m = b.model
    print(f"{name}  torch {torch.__version__}  model {args.model} ({m.num_layers}x{m.hidden_size}, vocab "
          f"{args.vocab}) seq {m.seq_length} {args.precision}  peak {peak or '-'} TFLOP/s")
    print(f"best micro-batch by {probe}'s tokens/s:\n" + "\n".join(lines))
    if batch is None:
        print("no micro-batch fits")
        return 1
    print(f"micro-batch {batch}: {b.flops(batch) / (batch * b.model.seq_length):.3g} FLOPs/token")
    print(f"{'mode':<8}{'batch':>6}{'step ms':>9}{'tokens/s':>11}{'TFLOP/s':>9}{'MFU':>7}{'loss':>8}"
          f"{'GiB':>8}  kernels")
    results = []
    for mode in modes:
        if time.perf_counter() - start > args.budget_s:
            print(f"{mode:<8} skipped: past the --budget-s of {args.budget_s:.0f} s")
            continue
        results.append(measure(mode, batch, b))
        print(row(results[-1], peak), flush=True)
    print("\n".join(ratios(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
