"""Sampling completions from a Hugging Face causal LM, in batches of left-padded prompts.

Left padding keeps every row's last prompt token at the same position, so each row's new tokens follow
its own prompt (right padding would put pad tokens between a short prompt and its continuation). Prompts
longer than the model's positions allow (with ``max_new_tokens`` room) are cut from the left, as the
convert hook's sample does. Generation stops early once every row holds a stop sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainer.convert.hf_io import hf_positions
from trainer.eval.config import STOP_SEQUENCES


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = 256
    top_p: float = 0.95
    batch_size: int = 16
    seed: int = 1234


class _StopWhenAllStopped:
    """A transformers stopping criterion: True per row once its new text holds a stop sequence."""

    def __init__(self, tokenizer, prompt_len: int, stops: Sequence[str]) -> None:
        self.tokenizer, self.prompt_len, self.stops = tokenizer, prompt_len, stops

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **_) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.prompt_len:], skip_special_tokens=True)
        return torch.tensor([any(s in t for s in self.stops) for t in texts], device=input_ids.device)


class HFCompleter:
    """``completer(prompts, temperature)`` for :func:`trainer.eval.humaneval.evaluate` over an HF model."""

    def __init__(self, model, tokenizer, cfg: SamplingConfig, device: torch.device) -> None:
        self.model, self.tok, self.cfg, self.device = model, tokenizer, cfg, device
        self.tok.padding_side = self.tok.truncation_side = "left"
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        self.n_pos = hf_positions(model.config)
        self.generated_tokens = 0

    def __call__(self, prompts: list[str], temperature: float) -> list[str]:
        out: list[str] = []
        torch.manual_seed(self.cfg.seed)
        for i in range(0, len(prompts), self.cfg.batch_size):
            out += self._batch(prompts[i:i + self.cfg.batch_size], temperature)
        return out

    @torch.no_grad()
    def _batch(self, prompts: list[str], temperature: float) -> list[str]:
        from transformers import StoppingCriteriaList

        new = min(self.cfg.max_new_tokens, self.n_pos - 1)
        enc = self.tok(prompts, return_tensors="pt", padding=True, truncation=True,
                       max_length=self.n_pos - new)
        ids, mask = enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)
        sampling = ({"do_sample": True, "temperature": temperature, "top_p": self.cfg.top_p}
                    if temperature > 0 else {"do_sample": False})
        stop = _StopWhenAllStopped(self.tok, ids.shape[1], STOP_SEQUENCES)
        got = self.model.generate(ids, attention_mask=mask, max_new_tokens=new,
                                  pad_token_id=self.tok.pad_token_id,
                                  stopping_criteria=StoppingCriteriaList([stop]), **sampling)
        self.generated_tokens += int((got[:, ids.shape[1]:] != self.tok.pad_token_id).sum())
        return self.tok.batch_decode(got[:, ids.shape[1]:], skip_special_tokens=True)
