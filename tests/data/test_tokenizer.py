"""Tokenizer training and loading: tiktoken fast path == HF tokenizers == GPT-2's own BPE algorithm.

The third oracle is transformers' pure-Python GPT-2 BPE (OpenAI encoder.py's algorithm with the `regex`
module, the code Megatron's gpt2_tokenization.py also copies). In transformers 5 GPT2Tokenizer itself runs
on HF tokenizers, so the Python algorithm is taken from ClvpTokenizer, whose ``bpe``/``pat``/byte tables
are GPT-2's verbatim (its English normalizer is bypassed by calling those parts directly).
"""

from __future__ import annotations

import json
import random

import pytest

from tests.data.oracles import GPT2Oracle
from trainer.config import CorpusConfig
from trainer.data.corpus import iter_documents
from trainer.data.tokenizer import (
    EOD_TOKEN,
    GPT2BPETokenizer,
    TokenizerFileError,
    TokenizerSpec,
    load_gpt2_bpe,
)
from trainer.data.train_tokenizer import TokenizerTrainConfig, train_tokenizer
from trainer.data.train_tokenizer import main as train_main

MULTILINGUAL = [
    "日本語のテキストと漢字、中文句子，한국어 문장입니다。",
    "emoji 🎉🚀 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👍🏽 keycap 1️⃣",
    "accents: café naïve résumé Ångström; combining: e\u0301 a\u0308 n\u0303 — Ελληνικά, Русский текст",
    "RTL: مرحبا بالعالم 123 ١٢٣ — עברית שלום, mixed \u200fמ\u200e and \u202bembedded\u202c",
    "whitespace runs:\t\t\tx  \n\n\n   y\r\n\r\n z\u00a0\u00a0w\u3000\u3000v",
    "control whitespace \x0b\x0c\x1c\x1d\x1e\x1f\x85\u2028\u2029end   ",
    "contractions: it's we'll they've I'd you're I'M DON'T 'S 'll", "numbers ½ ² ٣ 𝟙 Ⅻ 3.14e-10 0x1F",
    "zero width\u200bjoin\u200dnon\ufeffbom \U0001d538\U0001d539 \U000e0041 private \ue000 \U0010fffd",
    "Thai ภาษาไทย Devanagari हिन्दी Tamil தமிழ் Georgian ქართული",
    "   leading spaces", "trailing spaces   ", "", " ", "\n", "a", "<|endoftext|>", "x<|endoftext|>y",
]




@pytest.fixture(scope="module")
def stdlib_docs():
    """~6 MB of real Python: the interpreter's stdlib, tests excluded (deterministic order)."""
    config = CorpusConfig(exclude_tests=True, max_bytes=6_000_000)
    return [d["content"] for d in iter_documents(config)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, stdlib_docs):
    folder = tmp_path_factory.mktemp("tok")
    corpus = folder / "train.jsonl"
    corpus.write_text("".join(json.dumps({"content": d}) + "\n" for d in stdlib_docs[::3]))
    vocab, merges = train_tokenizer(TokenizerTrainConfig([str(corpus)], str(folder / "out"), vocab_size=8000))
    return vocab, merges


def test_training_is_deterministic_and_gpt2_shaped(trained, tmp_path):
    vocab_file, merge_file = trained
    vocab = json.loads(vocab_file.read_text())
    assert vocab[EOD_TOKEN] == 0 and len(vocab) == 8000
    assert merge_file.read_text().startswith("#version") and merge_file.read_text().endswith("\n")
    # Same data again, through the CLI: identical files.
    corpus = vocab_file.parent.parent / "train.jsonl"
    assert train_main(["--input", str(corpus), "--output-dir", str(tmp_path / "again"),
                       "--vocab-size", "8000"]) == 0
    assert (tmp_path / "again" / "vocab.json").read_bytes() == vocab_file.read_bytes()
    assert (tmp_path / "again" / "merges.txt").read_bytes() == merge_file.read_bytes()


def test_fast_path_is_chosen_and_has_megatron_attributes(trained):
    tok = load_gpt2_bpe(*trained)
    assert tok.backend == "tiktoken" and tok.fallback_reasons == []
    assert tok.vocab_size == 8000 and tok.eod_id == tok.eod == 0
    text = "def f(x):\n    return x  # <|endoftext|> stays text\n"
    ids = tok.encode(text)
    assert 0 not in ids and tok.decode(ids) == text
    assert tok.encode_to_numpy(text).tolist() == ids and tok.encode_batch([text, ""]) == [ids, []]


def test_equivalence_on_stdlib_corpus(trained, stdlib_docs):
    fast = load_gpt2_bpe(*trained)
    hf = load_gpt2_bpe(*trained, backend="hf")
    assert hf.backend == "hf"
    docs = stdlib_docs[1::3]  # documents the tokenizer was not trained on (~2 MB)
    fast_ids = fast.encode_batch(docs)
    assert fast_ids == hf.encode_batch(docs)
    oracle = GPT2Oracle(*trained)
    for doc, ids in zip(docs[:60], fast_ids[:60], strict=True):  # the Python oracle is slow: a subset
        assert ids == oracle.encode(doc)
    assert all(fast.decode(ids) == doc for doc, ids in zip(docs, fast_ids, strict=True))


def test_equivalence_on_multilingual_text(trained):
    fast, hf, oracle = load_gpt2_bpe(*trained), load_gpt2_bpe(*trained, backend="hf"), GPT2Oracle(*trained)
    rng = random.Random(0)
    # Plus random code points from all planes, each in contexts that exercise every regex branch.
    points = [c for c in rng.sample(range(0x110000), 4000) if not 0xD800 <= c < 0xE000]
    texts = MULTILINGUAL + [f"a{c} x{c}{c}1 {c}  \n{c}" for c in map(chr, points)]
    for text in texts:
        want = oracle.encode(text)
        assert fast.encode(text) == want, text
        assert hf.encode(text) == want, text
        assert fast.decode(want) == text
    assert fast.encode(EOD_TOKEN) != [fast.eod_id]


def _write_bpe(folder, merges, extra=(), ids=None):
    """A tiny GPT-2-layout tokenizer: <|endoftext|>, the 256 byte tokens, then one token per merge."""
    from trainer.data.bpe_equivalence import bytes_to_unicode

    vocab = {EOD_TOKEN: 0}
    for ch in sorted(bytes_to_unicode().values()):
        vocab[ch] = len(vocab)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    for tok in extra:
        vocab.setdefault(tok, len(vocab))
    if ids:
        vocab.update(ids)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return folder / "vocab.json", folder / "merges.txt"


def test_unprovable_files_fall_back_to_hf_and_stay_exact(tmp_path):
    # "he" merges before "th", yet "the" is built from "th"+"e": GPT-2 BPE encodes "the" as t|he, while a
    # naive tiktoken table would return the single token "the". The load-time proof must refuse it.
    vocab_file, merge_file = _write_bpe(tmp_path, [("h", "e"), ("t", "h"), ("th", "e")])
    tok = load_gpt2_bpe(vocab_file, merge_file)
    assert tok.backend == "hf"
    assert "'the' is not its own BPE encoding" in tok.fallback_reasons[0]
    oracle = GPT2Oracle(vocab_file, merge_file)
    for text in ["the", "then the", "tthe hehe", "<|endoftext|>"]:
        assert tok.encode(text) == oracle.encode(text)
    assert tok.encode("the") == [vocab_id(vocab_file, "t"), vocab_id(vocab_file, "he")]
    with pytest.raises(TokenizerFileError, match="not provably equal"):
        GPT2BPETokenizer(TokenizerSpec(str(vocab_file), str(merge_file), "tiktoken"))


def vocab_id(vocab_file, token):
    return json.loads(vocab_file.read_text())[token]


def test_merge_order_must_match_id_order(tmp_path):
    vocab_file, merge_file = _write_bpe(tmp_path, [("a", "b"), ("c", "d")], ids={"ab": 400, "cd": 300})
    tok = load_gpt2_bpe(vocab_file, merge_file)
    assert tok.backend == "hf" and "does not increase with merge order" in tok.fallback_reasons[0]
    # Tokens no merge produces cannot come out of GPT-2 BPE; they do not block the fast path.
    vocab_file, merge_file = _write_bpe(tmp_path, [("a", "b")], extra=["<pad>", "zzz"])
    assert load_gpt2_bpe(vocab_file, merge_file).backend == "tiktoken"


@pytest.mark.parametrize("merges_text, message", [
    ("a b\nc d\n", "not a '#version' header"),
    ("#version: 0.2\na b", "does not end with a newline"),
    ("#version: 0.2\na b c\n", "line 2 is 'a b c'"),
])
def test_merges_files_megatron_would_misread_are_refused(tmp_path, merges_text, message):
    vocab_file, merge_file = _write_bpe(tmp_path, [("a", "b")])
    merge_file.write_text(merges_text)
    with pytest.raises(TokenizerFileError, match=message):
        load_gpt2_bpe(vocab_file, merge_file)


def test_missing_eod_is_refused(tmp_path):
    vocab_file, merge_file = _write_bpe(tmp_path, [("a", "b")])
    vocab = json.loads(vocab_file.read_text())
    del vocab[EOD_TOKEN]
    vocab_file.write_text(json.dumps(vocab))
    with pytest.raises(TokenizerFileError, match="no '<\\|endoftext\\|>' entry"):
        load_gpt2_bpe(vocab_file, merge_file)
