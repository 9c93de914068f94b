"""Prompt-lookup drafts: an n-gram index of one sequence's tokens, updated as tokens are appended, that proposes the
tokens which followed the latest earlier occurrence of the context's longest suffix (vLLM's ``method="ngram"``).

For ``n`` from ``max_n`` down to ``min_n``: if the last ``n`` tokens occurred earlier in the context, the draft is the
``k`` tokens that followed their latest earlier occurrence; else no draft. Where those run into the end of the
context, the draft goes on as the repetition they start (a loop of period ``len(tokens) - e`` repeats). Appending a
token costs ``max_n - min_n + 1`` dict updates and a proposal as many lookups, whatever the context's length::

    tokens = prompt + output
    for n in range(max_n, min_n - 1, -1):
        suffix = tokens[-n:]
        ends = [e for e in range(n, len(tokens)) if tokens[e - n : e] == suffix]   # earlier occurrences
        if ends:
            e = ends[-1]
            return [tokens[e + i % (len(tokens) - e)] for i in range(k)]
    return []
"""

from __future__ import annotations

from collections.abc import Iterable


class NgramIndex:
    """The n-grams (``min_n`` to ``max_n`` tokens) of one sequence, each with the end of its two latest occurrences."""

    def __init__(self, tokens: Iterable[int] = (), *, min_n: int = 1, max_n: int = 4) -> None:
        for name, value in (("prompt_lookup_min", min_n), ("prompt_lookup_max", max_n)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if min_n > max_n:
            raise ValueError(f"prompt_lookup_min ({min_n}) must be <= prompt_lookup_max ({max_n})")
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        # n-gram -> (end of its latest occurrence, end of the one before, or -1)
        self._ends: dict[tuple[int, ...], tuple[int, int]] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        """One more token of the sequence (committed, not a draft)."""
        self.tokens.append(int(token))
        end = len(self.tokens)
        for n in range(self.min_n, min(self.max_n, end) + 1):
            gram = tuple(self.tokens[end - n : end])
            latest = self._ends.get(gram)
            self._ends[gram] = (end, latest[0] if latest is not None else -1)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(token)

    def truncate(self, length: int) -> None:
        """Forget the tokens from ``length`` on (a rollback); rebuilds the index, which rollbacks make rare."""
        if not 0 <= length <= len(self.tokens):
            raise ValueError(f"length must be in [0, {len(self.tokens)}], got {length!r}")
        if length == len(self.tokens):
            return
        kept = self.tokens[:length]
        self.tokens, self._ends = [], {}
        self.extend(kept)

    def propose(self, k: int) -> list[int]:
        """``k`` draft tokens: those that followed the latest earlier occurrence of the longest suffix of
        ``min_n``..``max_n`` tokens that occurred before (as a repetition where they reach the end); [] when none
        did."""
        return self.propose_matched(k)[0]

    def propose_matched(self, k: int, reach: int = 0) -> tuple[list[int], int]:
        """``propose(k)`` and the length of the match behind it (0 when none): the suffix's ``n`` tokens, or with
        ``reach`` > ``n``, how many of the latest tokens (at most ``reach``) equal those before the proposal's source,
        so that a match followed for many tokens (a copy going on) shows as such."""
        end = len(self.tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            ends = self._ends.get(tuple(self.tokens[end - n :]))
            if ends is not None and ends[1] >= 0:
                start = ends[1]
                period = end - start
                matched, tokens = n, self.tokens
                while matched < min(reach, start) and tokens[start - 1 - matched] == tokens[end - 1 - matched]:
                    matched += 1
                return [self.tokens[start + i % period] for i in range(k)], matched
        return [], 0
