"""Tokenizer directories built here (no model hub): a byte-level BPE trained on the given texts."""

from __future__ import annotations

import json
from pathlib import Path

EOS = "<|endoftext|>"
BOS = "<s>"


def build_tokenizer_dir(texts: list[str], out_dir: Path, vocab_size: int = 3000, *, add_bos: bool = False,
                        eos: bool = True, eos_token: str = EOS) -> Path:
    """``out_dir`` with a ``tokenizer.json`` (and, with ``eos``, a tokenizer_config.json naming it).

    ``add_bos``: a post-processor puts ``<s>`` before every text, as Llama-style tokenizers do, so the
    tests see that Megatron keeps the tokens ``tokenizer(text)`` adds. ``eos_token`` other than GPT-2's
    shows a loader that falls back to GPT-2's defaults (which name ``<|endoftext|>``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[eos_token, BOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A",
                                                           special_tokens=[(BOS, tok.token_to_id(BOS))])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    if eos:
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token, "bos_token": BOS}
        (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


class HFOracle:
    """What Megatron's HuggingFaceTokenizer does: AutoTokenizer(DIR), ``tokenizer(text).input_ids``,
    ``len(tokenizer)`` and ``eos_token_id``."""

    def __init__(self, model_dir) -> None:
        from transformers import AutoTokenizer

        self.t = AutoTokenizer.from_pretrained(str(model_dir))
        self.vocab_size = len(self.t)
        self.eod = self.t.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.t(text).input_ids
