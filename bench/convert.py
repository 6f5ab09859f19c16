"""Conversion time and peak memory for a CodeParrot-small-sized (≈110M) random checkpoint → Hugging Face.

The checkpoint is written at (tp, pp) = (2, 2) by default from Slipway's own GPT initialisation, with a
synthetic 32768-token byte-level BPE. Each step runs in a fresh subprocess so its peak RSS is its own.
Baselines measured in the same run: the model's fp32 size, the RSS and time of a process that only
imports torch + transformers (the floor), and of one that only reads every shard (the I/O floor).

    python bench/convert.py                       # 12 layers, 768 hidden, vocab 32768, seq 1024, tp2 pp2
    python bench/convert.py --tp 1 --pp 1 --layers 2   # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

READ_SHARDS = """
import sys, torch
from pathlib import Path
for p in sorted(Path(sys.argv[1]).rglob("model_optim_rng.pt")):
    sd = torch.load(p, map_location="cpu", weights_only=True)
    sum(t.float().sum() for t in [v for v in sd["model"]["language_model"]["encoder"].values()])
"""
IMPORTS = "import torch, transformers; from transformers import GPT2LMHeadModel"


def synthetic_tokenizer(out: Path, vocab_size: int) -> None:
    """A valid byte-level BPE of exactly ``vocab_size`` tokens: 256 bytes, pair merges, <|endoftext|>."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = []
    for a in alphabet:
        for b in alphabet:
            if len(vocab) == vocab_size - 1:
                break
            if a + b not in vocab:
                vocab[a + b] = len(vocab)
                merges.append(f"{a} {b}")
    vocab["<|endoftext|>"] = len(vocab)
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")


def make_checkpoint(root: Path, a: argparse.Namespace) -> tuple[Path, int]:
    """A random GPT (Slipway's init) saved at (tp, pp); returns the folder and the parameter count."""
    from trainer.config.model import ModelConfig
    from trainer.convert.shards import write_checkpoint
    from trainer.model import build_gpt

    cfg = ModelConfig(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                    seq_length=a.seq, vocab_size=a.vocab)
    model = build_gpt(cfg, seed=1234)
    state = {"language_model." + k: v.detach() for k, v in model.named_parameters()}
    args = {"num_layers": a.layers, "hidden_size": a.hidden, "num_attention_heads": a.heads,
            "seq_length": a.seq, "max_position_embeddings": a.seq, "vocab_size": a.vocab,
            "padded_vocab_size": cfg.padded_vocab_size(a.tp), "tensor_model_parallel_size": a.tp,
            "pipeline_model_parallel_size": a.pp, "vocab_file": str(root / "vocab.json"),
            "merge_file": str(root / "merges.txt"), "run_id": "bench", "consumed_train_samples": 0}
    if cfg.padded_vocab_size(a.tp) != cfg.padded_vocab_size(1):
        raise SystemExit("choose a vocab whose padding does not depend on tp for this bench")
    write_checkpoint(root / "checkpoints", state, args, 1000, (a.tp, a.pp))
    return root / "checkpoints", sum(t.numel() for t in state.values())


def measure(cmd: list[str]) -> tuple[float, float, float]:
    """(wall s, CPU s, peak RSS GiB) of one subprocess, from its own rusage (wait4); CPU time is the
    figure to trust on a loaded machine."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} failed with {os.waitstatus_to_exitcode(status)}")
    return seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 2**20  # ru_maxrss: KiB on Linux


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--make-into", type=Path, help=argparse.SUPPRESS)  # internal: the checkpoint subprocess
    a = p.parse_args()
    if a.make_into:
        synthetic_tokenizer(a.make_into, a.vocab)
        _, params = make_checkpoint(a.make_into, a)
        (a.make_into / "params.txt").write_text(str(params))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # A child's ru_maxrss starts at its parent's RSS (it survives fork and exec), so this process
        # stays small: the model is built in a subprocess too.
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--make-into", str(root)], check=True)
        ckpt, params = root / "checkpoints", int((root / "params.txt").read_text())
        fp32_gib = params * 4 / 2**30
        t_import, c_import, rss_import = measure([sys.executable, "-c", IMPORTS])
        t_read, c_read, rss_read = measure([sys.executable, "-c", READ_SHARDS, str(ckpt)])
        t_conv, c_conv, rss_conv = measure([sys.executable, "-m", "trainer.convert.to_hf", "--checkpoint-dir",
                                    str(ckpt), "--output-dir", str(root / "hf")])
        card = (root / "hf" / "README.md").read_text()
        check = next(line for line in card.splitlines() if line.startswith("verification"))
    print(f"model: {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}, seq {a.seq}: {params / 1e6:.1f}M "
          f"params, {fp32_gib:.2f} GiB fp32; checkpoint tp={a.tp} pp={a.pp}")
    for what, t, c, rss in (("baseline import torch+transformers", t_import, c_import, rss_import),
                            ("baseline read all shards", t_read, c_read, rss_read),
                            ("to_hf (merge, write, verify, card)", t_conv, c_conv, rss_conv)):
        print(f"{what:36s} wall {t:6.1f} s  CPU {c:6.1f} s  peak RSS {rss:5.2f} GiB")
    print(f"ratios: peak RSS / fp32 model = {rss_conv / fp32_gib:.2f}x; (peak RSS - import floor) / fp32 "
          f"model = {(rss_conv - rss_import) / fp32_gib:.2f}x; CPU time / (import + read) = "
          f"{c_conv / (c_import + c_read):.2f}x")
    print(check)


if __name__ == "__main__":
    main()
