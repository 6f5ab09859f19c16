"""When does a tiktoken ``Encoding`` built from vocab.json/merges.txt give exactly GPT-2 BPE's ids?

GPT-2 BPE (OpenAI's encoder.py, Megatron's gpt2_tokenization.py, HF ``tokenizers``) encodes a pre-token by
repeatedly merging the adjacent pair ``(u, v)`` that appears in merges.txt with the lowest line number,
leftmost first. tiktoken instead merges the adjacent pair whose *concatenation* ``u+v`` has the lowest rank
in its rank table, and first looks the whole pre-token up in that table. With ranks = vocab ids the two agree
under three conditions, all checked here at load time:

A. Merge order = id order: every merge's parts and result are in the vocab, no result repeats, and the
   result ids strictly increase with the line number. The rank table holds exactly the 256 single bytes
   and the merge results (tokens no merge produces cannot come out of GPT-2 BPE, so they are left out).
B. Every single byte has its token (otherwise GPT-2 BPE cannot encode that byte at all).
C. Every merge result ``t`` is its own encoding: GPT-2 BPE run on the bytes of ``t`` alone gives ``[t]``.

Why this suffices (by induction over merge steps on the same pre-token): suppose both algorithms have
reached the same token sequence. Every pair GPT-2 BPE may merge, tiktoken may too, with the same priority
order (A). Conversely let tiktoken see adjacent ``u, v`` with ``w = u+v`` in its table. No merge so far has
crossed the boundary of ``w``'s span (merges never split tokens), so the tokens inside that span evolved
exactly as GPT-2 BPE on ``w`` alone does, and ``[u, v]`` is a state of that run. By C that run ends in
``[w]``, so its next merge is ``(u, v)``: the pair is in merges.txt. Both algorithms therefore see the same
candidates with the same order and pick the same one (lowest rank, leftmost: ties are the same pair at
several places). The whole-pre-token lookup agrees by C. Pre-tokenization uses GPT-2's regex in both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character table (printable Latin-1 bytes map to themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    """Inverse of :func:`bytes_to_unicode`."""
    return {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(token: str) -> bytes | None:
    """The bytes a vocab entry stands for, or None when it uses characters outside the byte table."""
    table = unicode_to_bytes()
    try:
        return bytes(table[c] for c in token)
    except KeyError:
        return None


@dataclass
class EquivalenceReport:
    """Outcome of :func:`tiktoken_ranks`: ``ranks`` is set exactly when ``problems`` is empty."""

    ranks: dict[bytes, int] | None
    problems: list[str] = field(default_factory=list)

    @property
    def equivalent(self) -> bool:
        return not self.problems


def _bpe(word: str, merge_rank: dict[tuple[str, str], int]) -> list[str]:
    """GPT-2 BPE of one byte-level string: merge the lowest-ranked adjacent pair, leftmost, until none."""
    parts = list(word)
    get = merge_rank.get
    while len(parts) > 1:
        best = best_at = None
        for i in range(len(parts) - 1):
            rank = get((parts[i], parts[i + 1]))
            if rank is not None and (best is None or rank < best):
                best, best_at = rank, i
        if best is None:
            break
        parts[best_at:best_at + 2] = [parts[best_at] + parts[best_at + 1]]
    return parts


def _check_merges(vocab: dict[str, int], merges: list[tuple[str, str]], problems: list[str]) -> None:
    """Condition A."""
    seen: set[str] = set()
    last_id = -1
    for line, (left, right) in enumerate(merges, start=2):  # line 1 is the #version header
        result = left + right
        missing = [t for t in (left, right, result) if t not in vocab]
        if missing:
            problems.append(f"merges.txt line {line} ({left} {right}): {missing[0]!r} is not in vocab.json")
        elif result in seen:
            problems.append(f"merges.txt line {line}: {result!r} is produced by two merges")
        elif vocab[result] <= last_id:
            problems.append(f"merges.txt line {line}: id {vocab[result]} of {result!r} does not increase "
                            f"with merge order (previous merge result has id {last_id})")
        else:
            last_id = vocab[result]
            seen.add(result)
        if len(problems) >= 5:
            return


def tiktoken_ranks(vocab: dict[str, int], merges: list[tuple[str, str]]) -> EquivalenceReport:
    """The rank table for tiktoken when it provably reproduces GPT-2 BPE on these files, else the reasons."""
    problems: list[str] = []
    if len(set(vocab.values())) != len(vocab) or min(vocab.values(), default=0) < 0:
        problems.append("vocab.json ids are not unique non-negative integers")
    missing_bytes = [c for c in bytes_to_unicode().values() if c not in vocab]
    if missing_bytes:
        problems.append(f"vocab.json lacks {len(missing_bytes)} of the 256 byte tokens "
                        f"(first: {missing_bytes[0]!r})")
    _check_merges(vocab, merges, problems)
    if problems:
        return EquivalenceReport(None, problems)
    merge_rank = {pair: i for i, pair in enumerate(merges)}
    ranks = {bytes([b]): vocab[c] for b, c in bytes_to_unicode().items()}
    for left, right in merges:
        token = left + right
        # A two-character token's only pair is its own merge, so it trivially encodes to itself.
        got = [token] if len(token) == 2 else _bpe(token, merge_rank)
        if got != [token]:
            problems.append(f"merge result {token!r} is not its own BPE encoding (GPT-2 BPE gives {got})")
            if len(problems) >= 5:
                break
            continue
        encoded = token_bytes(token)
        if encoded is not None:  # else it has characters byte-level input never contains: unreachable
            ranks[encoded] = vocab[token]
    return EquivalenceReport(None if problems else ranks, problems)
