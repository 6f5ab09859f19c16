"""When does a tiktoken ``Encoding`` built from vocab.json/merges.txt give exactly GPT-2 BPE's ids?

GPT-2 BPE (OpenAI's encoder.py, Megatron's gpt2_tokenization.py, HF ``tokenizers``) encodes a pre-token by
repeatedly merging the adjacent pair ``(u, v)`` that appears in merges.txt with the lowest line number,
leftmost first. tiktoken instead merges the adjacent pair whose *concatenation* ``u+v`` has the lowest rank
in its rank table, and first looks the whole pre-token up in that table. With ranks = vocab ids the two agree
under three conditions, all checked here at load time:

A. Merge order = id order: every merge's parts and result are in the vocab, no result repeats, and the
   result ids strictly increase with the line number. The rank table holds exactly the 256 single bytes
   and the merge results (tokens no merge produces cannot come out of GPT-2 BPE, so they are left out).
   Each part is a single character or the result of an *earlier* line (as in every trained merges.txt).
   So every pair a merge creates ranks after that merge, the ranks a run applies never decrease, and
   OpenAI's encoder.py (all occurrences of the best pair per pass) and one leftmost pair at a time (HF,
   :func:`_bpe`) agree. Without it they do not: ``ab a`` listed before ``a b`` encodes ``abab`` as
   ``ab|ab`` in encoder.py but ``aba|b`` in HF and tiktoken.
B. Every single byte has its token (otherwise GPT-2 BPE cannot encode that byte at all).
C. Every merge result ``t`` is its own encoding: GPT-2 BPE run on the bytes of ``t`` alone gives ``[t]``.
   Checked in time linear in the merges (:func:`_not_self_encoding`), not by running BPE on each ``t``.

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


@lru_cache(maxsize=1)
def _to_latin1() -> dict[int, int]:
    """str.translate table: byte-table character → the Latin-1 character of its byte; every other code
    point below 256 → U+FFFF, so that ``encode("latin-1")`` fails exactly on characters outside the table."""
    table = {c: 0xFFFF for c in range(256)}
    table.update({ord(c): b for c, b in unicode_to_bytes().items()})
    return table


def token_bytes(token: str) -> bytes | None:
    """The bytes a vocab entry stands for, or None when it uses characters outside the byte table."""
    try:  # translate + encode run in C: this is called once per vocab entry at every tokenizer load
        return token.translate(_to_latin1()).encode("latin-1")
    except UnicodeEncodeError:
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
    made: set[str] = set()
    last_id = -1
    for line, (left, right) in enumerate(merges, start=2):  # line 1 is the #version header
        result = left + right
        result_id = vocab.get(result)
        if result_id is None or left not in vocab or right not in vocab:
            missing = [t for t in (left, right, result) if t not in vocab]
            problems.append(f"merges.txt line {line} ({left} {right}): {missing[0]!r} is not in vocab.json")
        elif result in made:
            problems.append(f"merges.txt line {line}: {result!r} is produced by two merges")
        elif result_id <= last_id:
            problems.append(f"merges.txt line {line}: id {result_id} of {result!r} does not increase "
                            f"with merge order (previous merge result has id {last_id})")
        elif (len(left) > 1 and left not in made) or (len(right) > 1 and right not in made):
            part = left if len(left) > 1 and left not in made else right
            problems.append(f"merges.txt line {line} ({left} {right}): {part!r} is neither a single "
                            "character nor the result of an earlier merge")
        else:
            last_id = result_id
            made.add(result)
        if len(problems) >= 5:
            return


def _not_self_encoding(merges: list[tuple[str, str]], merge_rank: dict[tuple[str, str], int]) -> list[int]:
    """Indices of the merges whose result is not its own GPT-2 BPE encoding (condition C), given A.

    By A the ranks applied on ``w = l + r`` (line ``i``) never decrease, and ``l``, ``r`` come from earlier
    lines. If no merge ever joins a token of ``l``'s span to one of ``r``'s, each span evolves as BPE on it
    alone, so ``[w]`` comes out iff ``l`` and ``r`` are their own encodings (checked at their lines) and no
    such crossing merge happens. Only a token on ``l``'s right spine (``l``, its right part, that one's
    right part, ... a character) can end ``l``'s span, and only one on ``r``'s left spine can start ``r``'s.
    A spine token lives from its own rank (a character: from the start) until its parent's (``l``'s and
    ``r``'s parent is ``w``, rank ``i``), so each spine's lifetimes tile the run and the two walk up in
    step, past each pair ``(a, b)`` that is ever adjacent. It is merged iff its rank ``beta`` comes while
    both live: ``beta < rank(parent of a)`` (at equal rank the left copy of the pair goes first) and
    ``beta <= rank(parent of b)`` (A makes ``beta`` exceed both births). That is a few dict look-ups per
    merge instead of one BPE run per merge; the test suite compares it with :func:`_bpe`.
    """
    rank_of: dict[str, int] = {}  # merge result → its line index
    left_spine: dict[str, tuple[str, ...]] = {}  # w, its left part, that one's left part, ... a character
    right_spine: dict[str, tuple[str, ...]] = {}
    failed: list[int] = []
    get = merge_rank.get
    for i, (left, right) in enumerate(merges):
        ends = right_spine.get(left, (left,)) if left in rank_of or len(left) == 1 else None
        starts = left_spine.get(right, (right,)) if right in rank_of or len(right) == 1 else None
        if ends is None or starts is None:  # a part that is not its own encoding cannot be formed
            failed.append(i)
            continue
        ka, kb = len(ends) - 1, len(starts) - 1  # from the characters up
        while ka or kb:
            parent_a = rank_of[ends[ka - 1]] if ka else i
            parent_b = rank_of[starts[kb - 1]] if kb else i
            beta = get((ends[ka], starts[kb]))
            if beta is not None and beta < parent_a and beta <= parent_b:
                break  # a crossing merge: w never forms
            if ka and parent_a < parent_b:  # a is absorbed first: its parent ends l's span next
                ka -= 1
            else:
                kb -= 1
        else:
            word = left + right
            rank_of[word] = i
            left_spine[word] = (word, *left_spine.get(left, (left,)))
            right_spine[word] = (word, *right_spine.get(right, (right,)))
            continue
        failed.append(i)
    return failed


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
    for i in _not_self_encoding(merges, merge_rank)[:5]:
        token = merges[i][0] + merges[i][1]
        problems.append(f"merge result {token!r} is not its own BPE encoding "
                        f"(GPT-2 BPE gives {_bpe(token, merge_rank)})")
    if problems:
        return EquivalenceReport(None, problems)
    ranks = {bytes([b]): vocab[c] for b, c in bytes_to_unicode().items()}
    for left, right in merges:
        token = left + right
        encoded = token_bytes(token)
        if encoded is not None:  # else it has characters byte-level input never contains: unreachable
            ranks[encoded] = vocab[token]
    return EquivalenceReport(ranks, problems)
