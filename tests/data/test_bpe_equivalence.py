"""The load-time proof that tiktoken reproduces GPT-2 BPE: its linear-time condition C against running
GPT-2 BPE on every merge result, and the merge-order condition that makes one-pair-at-a-time BPE (HF,
tiktoken) agree with OpenAI's encoder.py (all occurrences of the best pair per pass)."""

from __future__ import annotations

import json
import random

import pytest

from tests.data.oracles import GPT2Oracle
from trainer.config import CorpusConfig
from trainer.data.bpe_equivalence import (
    _bpe,
    _not_self_encoding,
    bytes_to_unicode,
    tiktoken_ranks,
    token_bytes,
    unicode_to_bytes,
)
from trainer.data.corpus import iter_documents
from trainer.data.tokenizer import EOD_TOKEN, load_gpt2_bpe, read_merges, read_vocab
from trainer.data.train_tokenizer import TokenizerTrainConfig, train_tokenizer


def _by_bpe(merges: list[tuple[str, str]]) -> list[int]:
    """Condition C the slow way: GPT-2 BPE on each merge result alone."""
    rank = {pair: i for i, pair in enumerate(merges)}
    return [i for i, (a, b) in enumerate(merges) if _bpe(a + b, rank) != [a + b]]


def _random_merges(rng: random.Random) -> list[tuple[str, str]]:
    """Merges over a small alphabet whose parts are characters or earlier results (condition A)."""
    tokens = list("abcde"[:rng.randint(1, 5)])
    merges, made = [], set()
    for _ in range(rng.randint(1, 40)):
        left, right = rng.choice(tokens), rng.choice(tokens)
        if left + right not in made:
            made.add(left + right)
            merges.append((left, right))
            tokens.append(left + right)
    return merges


def test_linear_condition_c_equals_running_bpe_on_random_tables():
    rng = random.Random(0)
    refused = 0
    for _ in range(5000):
        merges = _random_merges(rng)
        got = _not_self_encoding(merges, {pair: i for i, pair in enumerate(merges)})
        assert got == _by_bpe(merges), merges
        refused += bool(got)
    assert 1000 < refused < 4900  # both outcomes are exercised, many times


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bpe")
    docs = [d["content"] for d in iter_documents(CorpusConfig(max_bytes=3_000_000))]
    corpus = folder / "train.jsonl"
    corpus.write_text("".join(json.dumps({"content": d}) + "\n" for d in docs))
    return train_tokenizer(TokenizerTrainConfig([str(corpus)], str(folder / "out"), vocab_size=6000))


def test_linear_condition_c_equals_running_bpe_on_a_trained_tokenizer(trained):
    vocab, merges = read_vocab(trained[0]), read_merges(trained[1])
    assert _by_bpe(merges) == [] == _not_self_encoding(merges, {p: i for i, p in enumerate(merges)})
    assert tiktoken_ranks(vocab, merges).equivalent
    # Move single merges to the earliest line their parts allow: some results stop being their own
    # encoding (a lower-ranked pair now crosses them), and the fast check finds exactly those.
    line = {a + b: i for i, (a, b) in enumerate(merges)}
    rng, refused = random.Random(1), 0
    for _ in range(30):
        moved = list(merges)
        i = rng.randrange(len(moved))
        a, b = moved[i]
        moved.insert(max(line.get(a, -1), line.get(b, -1)) + 1, moved.pop(i))
        got = _not_self_encoding(moved, {p: i for i, p in enumerate(moved)})
        assert got == _by_bpe(moved)
        refused += bool(got)
    assert refused


def _write(folder, merges):
    vocab = {EOD_TOKEN: 0}
    for ch in sorted(bytes_to_unicode().values()):
        vocab[ch] = len(vocab)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    return folder / "vocab.json", folder / "merges.txt"


def test_a_part_made_by_a_later_merge_is_refused(tmp_path):
    # "ab a" before "a b": ids still increase with the line, and every result is its own encoding, yet
    # OpenAI's encoder.py encodes "abab" as ab|ab (it merges both "a b" first) while a tiktoken table
    # built from these files gives aba|b. The proof must not accept it.
    vocab_file, merge_file = _write(tmp_path, [("ab", "a"), ("a", "b")])
    vocab = json.loads(vocab_file.read_text())
    assert GPT2Oracle(vocab_file, merge_file).encode("abab") == [vocab["ab"], vocab["ab"]]
    report = tiktoken_ranks(vocab, read_merges(merge_file))
    assert not report.equivalent
    assert "'ab' is neither a single character nor the result of an earlier merge" in report.problems[0]
    assert load_gpt2_bpe(vocab_file, merge_file).backend == "hf"


def test_token_bytes_matches_the_byte_table():
    table = unicode_to_bytes()
    chars = [*table, *map(chr, range(0, 0x200)), "中", "\U0001f389", "\uffff"]
    rng = random.Random(2)
    for _ in range(3000):
        token = "".join(rng.choice(chars) for _ in range(rng.randint(1, 6)))
        try:
            want = bytes(table[c] for c in token)
        except KeyError:
            want = None
        assert token_bytes(token) == want, repr(token)
