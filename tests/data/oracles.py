"""Reference tokenizers shared by the data tests."""

from __future__ import annotations


class GPT2Oracle:
    """GPT-2's reference BPE (transformers' Python implementation) on the given files."""

    def __init__(self, vocab_file, merge_file) -> None:
        from transformers.models.clvp.tokenization_clvp import ClvpTokenizer

        self.t = ClvpTokenizer(str(vocab_file), str(merge_file))

    def encode(self, text: str) -> list[int]:
        t = self.t
        return [t.encoder[tok] for piece in t.pat.findall(text)
                for tok in t.bpe("".join(t.byte_encoder[b] for b in piece.encode("utf-8"))).split(" ")]
