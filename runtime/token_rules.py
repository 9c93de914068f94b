"""Per-request token rules of vLLM's SamplingParams, as TokenMaskSources: ``allowed_token_ids``, ``bad_words`` and
``min_tokens``. Each becomes rows of the one packed bitmask (bit ``v % 32`` of word ``v // 32`` = token v allowed),
built once per request; filling a row is a copy of a precomputed row plus, for bad words, a few cleared bits.

* :class:`AllowedTokens`: only the listed ids, at every position::

      for v in range(V): row[v] = v in allowed_token_ids

* :class:`MinTokens`: while fewer than ``min_tokens`` tokens are out (counting the draft path), the stop tokens
  (EOS unless ``ignore_eos``, and ``stop_token_ids``) are banned::

      if accepted + len(draft_path) < min_tokens:
          for v in stop_ids: row[v] = False

* :class:`BadWords`: a word's last token is banned where the output ends with the word's other tokens (a one-token
  word is banned everywhere)::

      for word in words:  # token id sequences
          if (output + draft_path)[len - len(word) + 1:] == word[:-1]: row[word[-1]] = False

  Each bad word is tokenised as written and with one leading space (as vLLM does), since a word in running text
  is usually its own token after a space.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

from .mask_source import NeverForces


def _packed_row(vocab_size: int, ids: Iterable[int], allowed: bool) -> np.ndarray:
    """A bitmask row allowing exactly ``ids`` (``allowed``) or everything but ``ids``; padding bits past the
    vocabulary are left set (the bitmask kernel never reads them)."""
    bits = np.zeros((vocab_size + 31) // 32 * 32, bool)
    bits[np.fromiter(ids, np.int64)] = True
    if not allowed:
        np.logical_not(bits, out=bits)
    return np.packbits(bits, bitorder="little").view(np.int32)


def _check_ids(name: str, ids: Iterable[int], vocab_size: int) -> list[int]:
    checked = [int(t) for t in ids]
    bad = [t for t in checked if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name} token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return checked


class AllowedTokens(NeverForces):
    """Allows only ``token_ids`` at every position (vLLM's ``allowed_token_ids``)."""

    __slots__ = ("_row",)

    def __init__(self, token_ids: Sequence[int], vocab_size: int) -> None:
        ids = _check_ids("allowed_token_ids", token_ids, vocab_size)
        if not ids:
            raise ValueError("allowed_token_ids must name at least one token")
        self._row = _packed_row(vocab_size, ids, allowed=True)

    def fill_bitmask(self, row: np.ndarray, draft_path: Sequence[int]) -> bool:
        row[:] = self._row[: row.size]
        return True

    def accept_token(self, token_id: int) -> None:
        pass

    def rollback(self, num_tokens: int) -> None:
        pass


class MinTokens(NeverForces):
    """Bans ``stop_ids`` until ``min_tokens`` tokens have been generated (vLLM's ``min_tokens``)."""

    __slots__ = ("min_tokens", "_row", "_accepted")

    def __init__(self, min_tokens: int, stop_ids: Sequence[int], vocab_size: int) -> None:
        self.min_tokens = int(min_tokens)
        self._row = _packed_row(vocab_size, _check_ids("min_tokens stop", stop_ids, vocab_size), allowed=False)
        self._accepted = 0

    def fill_bitmask(self, row: np.ndarray, draft_path: Sequence[int]) -> bool:
        if self._accepted + len(draft_path) >= self.min_tokens:
            return False
        row[:] = self._row[: row.size]
        return True

    def accept_token(self, token_id: int) -> None:
        self._accepted += 1

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._accepted} were accepted")
        self._accepted -= num_tokens


class BadWords(NeverForces):
    """Bans the last token of each bad word where the output ends with the word's other tokens."""

    __slots__ = ("_always", "_words", "_tail", "_longest")

    def __init__(self, words: Sequence[Sequence[int]], vocab_size: int) -> None:
        checked = [_check_ids("bad_words", w, vocab_size) for w in words]
        checked = [w for w in checked if w]
        self._always = _packed_row(vocab_size, [w[0] for w in checked if len(w) == 1], allowed=False)
        self._words = [(tuple(w[:-1]), w[-1]) for w in checked if len(w) > 1]
        self._longest = max((len(p) for p, _ in self._words), default=0)
        self._tail: list[int] = []  # every accepted token (rollback needs them all)

    def fill_bitmask(self, row: np.ndarray, draft_path: Sequence[int]) -> bool:
        row[:] = self._always[: row.size]
        if self._words:
            start = max(0, len(self._tail) - self._longest)
            recent = (self._tail[start:] + [int(t) for t in draft_path])[-self._longest:]
            bits = row.view(np.uint32)
            for prefix, last in self._words:
                if len(recent) >= len(prefix) and tuple(recent[len(recent) - len(prefix):]) == prefix:
                    bits[last >> 5] &= np.uint32(~(1 << (last & 31)) & 0xFFFFFFFF)
        return True

    def accept_token(self, token_id: int) -> None:
        self._tail.append(int(token_id))

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= len(self._tail):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {len(self._tail)} were accepted")
        del self._tail[len(self._tail) - num_tokens:]


def bad_word_token_ids(words: Sequence[str], encode: Callable[[str], Sequence[int]]) -> list[list[int]]:
    """Each word tokenised as written and with one leading space (duplicates dropped, order kept)."""
    out: list[list[int]] = []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = list(encode(text))
            if ids and ids not in out:
                out.append(ids)
    return out


__all__ = ["AllowedTokens", "BadWords", "MinTokens", "bad_word_token_ids"]
