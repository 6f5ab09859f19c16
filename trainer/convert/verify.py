"""Verification: the source model and the HF model loaded back from disk must agree.

Same fixed prompts through both: the largest absolute logit difference (fp32) over every position of
prompt + continuation must be ≤ ``tolerance``, and greedy generation of ``new_tokens`` tokens by HF's
own ``generate`` (KV cache and all) must equal the source model's greedy continuation token for token.

The source side's greedy decode is checked teacher-forced: one forward over HF's generated sequence,
whose argmax at every position must be the next generated token. For a causal model this is the same
statement as "the source's step-by-step greedy decode produces this sequence" (the logits at position t
depend only on tokens ≤ t), at 1 forward per prompt instead of 32 — what makes verifying a 110M model
on a CPU take seconds, not minutes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from trainer.convert.hf_io import hf_positions
from trainer.log import get_logger

log = get_logger(__name__)

PROMPTS = (
    "def fibonacci(n):\n    ",
    "import numpy as np\nimport torch\n\n",
    "The quick brown fox jumps over the lazy dog. ",
    "class Dataset:\n    def __init__(self, path):",
)


class SourceModel(Protocol):
    def logits(self, ids: torch.Tensor) -> torch.Tensor: ...  # [s] → [s, vocab] fp32


@dataclass
class VerifyConfig:
    """How conversions are checked."""

    prompts: tuple[str, ...] = PROMPTS
    new_tokens: int = 32  # greedy continuation length
    tolerance: float = 1e-4  # max |logit difference| in fp32
    decode_threads: int | None = 1  # intra-op threads for HF's token-by-token generate (None: torch's)

    def __post_init__(self) -> None:
        if not self.prompts or self.new_tokens < 1 or self.tolerance <= 0:
            raise ValueError("VerifyConfig needs ≥1 prompt, new_tokens ≥ 1 and tolerance > 0")


@dataclass
class VerifyReport:
    """The figures that go into the model card."""

    max_abs_logit_diff: float
    greedy_identical: bool
    tolerance: float
    new_tokens: int
    prompts: int
    samples: list[dict[str, Any]] = field(default_factory=list)  # per prompt: text, diff, identical

    @property
    def passed(self) -> bool:
        return self.greedy_identical and self.max_abs_logit_diff <= self.tolerance

    def summary(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        return (f"verification {verdict}: max |Δlogit| = {self.max_abs_logit_diff:.3g} (fp32, limit "
                f"{self.tolerance:g}) over {self.prompts} prompts; greedy {self.new_tokens}-token generation "
                f"{'identical' if self.greedy_identical else 'DIFFERS'}")


def _prompt_ids(tokenizer: Any, text: str, max_len: int, vocab: int) -> torch.Tensor:
    """The prompt's ids; without a tokenizer (a bare HF model directory), its UTF-8 bytes mod vocab."""
    ids = tokenizer(text)["input_ids"] if tokenizer is not None else [b % vocab for b in text.encode()]
    ids = ids[-max_len:]
    if not ids:
        raise ValueError(f"prompt {text!r} encodes to no tokens")
    return torch.tensor(ids, dtype=torch.long)


@contextmanager
def _intra_op_threads(n: int | None) -> Iterator[None]:
    """Decoding is many tiny ops per token; on a shared or oversubscribed CPU the OpenMP hand-off costs
    more than the parallel work (32 tokens of a 110M model on a loaded 2-core box: 27 s with 2 threads,
    1 s with 1), so generation runs with ``n`` threads and the setting is restored afterwards."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def verify(source: SourceModel, hf_dir: Path, tokenizer: Any | None, cfg: VerifyConfig, config: Any = None
           ) -> VerifyReport:
    """Load ``hf_dir`` with ``AutoModelForCausalLM`` in fp32 and compare it with ``source``; ``config``: the
    model's config when it is not ``hf_dir/config.json`` yet (an unverified model: trainer.convert.swap)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, config=config).eval()
    n_pos = hf_positions(hf.config)
    new_tokens = min(cfg.new_tokens, n_pos - 1)
    worst, identical, samples = 0.0, True, []
    for text in cfg.prompts:
        ids = _prompt_ids(tokenizer, text, n_pos - new_tokens, hf.config.vocab_size)
        with _intra_op_threads(cfg.decode_threads):
            got = hf.generate(ids[None], attention_mask=torch.ones_like(ids)[None], do_sample=False,
                              max_new_tokens=new_tokens, eos_token_id=None,
                              pad_token_id=hf.config.pad_token_id)[0]
        ref = source.logits(got)
        # eos_token_id=None: HF must not stop early; the source's argmax must pick each generated token.
        same = len(got) == len(ids) + new_tokens and torch.equal(ref[len(ids) - 1:-1].argmax(-1),
                                                                  got[len(ids):])
        diff = (ref - hf(got[None]).logits[0].float()).abs().max().item()
        worst, identical = max(worst, diff), identical and same
        continuation = tokenizer.decode(got[len(ids):].tolist()) if tokenizer else None
        samples.append({"prompt": text, "max_abs_logit_diff": diff, "greedy_identical": same,
                        "continuation": continuation})
    del hf
    report = VerifyReport(worst, identical, cfg.tolerance, new_tokens, len(cfg.prompts), samples)
    (log.info if report.passed else log.error)("%s", report.summary())
    return report
