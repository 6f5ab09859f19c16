"""The model card (README.md): training provenance, architecture, and the verification figures."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainer.convert.spec import GPTSpec, arg
from trainer.convert.verify import VerifyReport


@dataclass
class Provenance:
    """Where the weights came from; None where unknown (the card says so)."""

    run_id: str | None = None
    iteration: int | str | None = None
    tokens_seen: int | None = None
    data: str | None = None
    val_loss: float | None = None
    source: str | None = None  # the checkpoint directory
    tp_size: int | None = None
    pp_size: int | None = None

    @classmethod
    def from_args(cls, args: Any, **known: Any) -> Provenance:
        """Read what the checkpoint's args say; ``known`` values (not None) take precedence."""
        samples = arg(args, "consumed_train_samples", arg(args, "consumed_samples"))
        seq = arg(args, "seq_length")
        tokens = arg(args, "tokens_seen", samples * seq if samples is not None and seq else None)
        data = arg(args, "data_path", arg(args, "data"))
        if isinstance(data, (list, tuple)):
            data = ", ".join(str(d) for d in data)
        found = cls(run_id=arg(args, "run_id"), tokens_seen=tokens, data=data,
                    val_loss=arg(args, "val_loss", arg(args, "final_val_loss")))
        for key, value in known.items():
            if value is not None:
                setattr(found, key, value)
        return found


def _fmt(value: Any) -> str:
    if value is None:
        return "unknown"
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


_TITLES = {"gpt2": "GPT-2", "llama": "Llama"}


def _parameters(spec: GPTSpec) -> int:
    """Parameters of the HF model (unpadded vocab): attention with KV groups, a GeLU or SwiGLU MLP, norms
    with or without bias, linear biases if any, the position table if learned, the head if untied."""
    h, f, n = spec.hidden_size, spec.ffn_hidden_size, spec.num_attention_heads
    kv = spec.query_groups * h // n
    glu = spec.activation == "silu"
    norm = 2 * h if spec.normalization == "layernorm" else h
    bias = (h + 2 * kv + h + (2 if glu else 1) * f + h) if spec.add_bias_linear else 0
    layer = (2 * h * h + 2 * h * kv) + (3 if glu else 2) * h * f + 2 * norm + bias
    positions = spec.max_position_embeddings * h if spec.position_embedding == "learned" else 0
    head = 0 if spec.tie_word_embeddings else spec.vocab_size * h
    return spec.num_layers * layer + spec.vocab_size * h + positions + norm + head


def render_card(spec: GPTSpec, prov: Provenance, report: VerifyReport, extra: dict[str, str]) -> str:
    """Markdown with YAML front matter; ``extra`` adds rows (e.g. dtype, transformers version)."""
    params = _parameters(spec)
    family = spec.check_family()
    rows = {"run id": prov.run_id, "iteration": prov.iteration, "tokens seen": prov.tokens_seen,
            "data": prov.data, "final validation loss": prov.val_loss, "source checkpoint": prov.source,
            "training layout": f"tp={prov.tp_size}, pp={prov.pp_size}" if prov.tp_size else None}
    arch = asdict(spec)
    lines = [
        "---", "library_name: transformers", "pipeline_tag: text-generation",
        f"tags: [{family}, slipway, megatron]", "---", "",
        f"# {_TITLES[family]} model ({params / 1e6:.1f}M parameters) trained with Slipway", "",
        "## Provenance", "", "| | |", "|---|---|",
        *(f"| {k} | {_fmt(v)} |" for k, v in rows.items()), "",
        "## Architecture", "", "| | |", "|---|---|",
        *(f"| {k} | {_fmt(v)} |" for k, v in arch.items()),
        *(f"| {k} | {v} |" for k, v in extra.items()), "",
        "## Conversion check", "", report.summary() + ".", "",
        "The Megatron-layout source model and this directory, loaded back with `AutoModelForCausalLM` in "
        "fp32, ran the same prompts:", "",
        "| prompt | max abs logit diff | greedy identical |", "|---|---|---|",
        *(f"| `{s['prompt']!r}` | {s['max_abs_logit_diff']:.3g} | {s['greedy_identical']} |"
          for s in report.samples), "",
        "## Use", "", "```python", "from transformers import pipeline",
        'generate = pipeline("text-generation", model="path/to/this/directory")',
        f'print(generate({report.samples[0]["prompt"]!r}, max_new_tokens=32)[0]["generated_text"])'
        if report.samples else "", "```", "",
    ]
    return "\n".join(lines)


def write_card(out_dir: Path, text: str) -> None:
    (out_dir / "README.md").write_text(text, encoding="utf-8")


def eval_section(results: dict[str, Any]) -> str:
    """The model card's evaluation section from ``<run_dir>/eval/results.json`` (trainer/eval/run.py)."""
    lines, he = [], results.get("humaneval")
    if he:
        s = results["settings"]
        lines += [f"HumanEval ({he['problems']} problems, {s['n_samples']} samples each, top-p {s['top_p']}; "
                  f"programs executed with isolation: {he['isolation']}):", "",
                  "| metric | value | temperature |", "|---|---|---|"]
        lines += [f"| {k} | {v:.4f} | {r['temperature']:g} |" for r in he["by_temperature"]
                  for k, v in r["pass_at"].items()]
        lines.append("")
    ppl = {k: v for k, v in results.get("perplexity", {}).items() if v}
    if ppl:
        lines += ["| perplexity on | tokens | loss | perplexity |", "|---|---|---|---|"]
        lines += [f"| {'held-out ' + v['split'] + ' split' if k == 'heldout' else f'`{k}`'} | "
                  f"{v['tokens']:,} | {v['loss']:.4f} | {v['perplexity']:.3f} |" for k, v in ppl.items()]
        lines.append("")
    return "\n".join(lines) or "No evaluation was configured.\n"


def replace_section(out_dir: Path, title: str, body: str) -> None:
    """Put ``## title`` with ``body`` into the card (README.md), replacing an earlier one of that title."""
    path = out_dir / "README.md"
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    head = f"## {title}\n"
    if head in text:
        before, rest = text.split(head, 1)
        after = rest[rest.find("\n## "):] if "\n## " in rest else ""
        text = before + after.lstrip("\n")
    write_card(out_dir, text.rstrip("\n") + f"\n\n{head}\n{body.rstrip()}\n")
