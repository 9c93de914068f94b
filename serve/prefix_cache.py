"""The prefix cache: finished sequences kept in the KV cache, found again by the longest prefix a new prompt shares.

When a sequence finishes, the engine may keep its KV cache instead of freeing it, and record its tokens here. A new
request whose prompt starts with some of those tokens (the same system prompt, the earlier turns of a conversation)
forks the cached sequence at the shared length and prefills only the rest, as vLLM's automatic prefix caching,
SGLang's RadixAttention and MLC-LLM's prefix cache do::

    match = cache.match(prompt)            # (seq_id, n): the entry sharing the longest prefix, n tokens of it
    runner.fork_sequence(match.seq_id, new_id); runner.popn(new_id, match.cached_length - match.length)
    runner.prefill([new_id], [prompt[match.length:]])
    ...
    for old in cache.insert(new_id, tokens_in_kv):    # ids to free: entries now covered, or evicted by size
        runner.remove_sequence(old)

The cache never touches the runner: every method returns the sequence ids the caller must free. Entries are evicted
least recently used first (a match counts as a use) when the tokens held pass ``max_tokens``, or when the caller
needs room (``evict``). An entry whose tokens are a prefix of a newer entry's is dropped: the newer one serves every
match the older one could.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PrefixMatch:
    """The cached sequence ``seq_id`` shares the first ``length`` tokens of a prompt (of its ``cached_length``)."""

    seq_id: int
    length: int
    cached_length: int


class PrefixCache:
    """Token sequences kept in the KV cache (seq id -> tokens), matched by longest common prefix, evicted LRU."""

    def __init__(self, max_tokens: int, max_entries: int) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"max_tokens must be an int >= 0, got {max_tokens!r}")
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 0:
            raise ValueError(f"max_entries must be an int >= 0, got {max_entries!r}")
        self.max_tokens = max_tokens
        self.max_entries = max_entries
        self._entries: OrderedDict[int, np.ndarray] = OrderedDict()  # least recently used first
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._entries

    @property
    def num_tokens(self) -> int:
        """Tokens held by all entries (each counted in full, although forks share pages)."""
        return self._tokens

    def match(self, prompt: Sequence[int], limit: int | None = None, touch: bool = True) -> PrefixMatch | None:
        """The entry sharing the longest prefix with ``prompt`` (at most ``limit`` tokens of it), or None when no
        entry shares a token; on ties the most recently used. The entry becomes the most recently used (unless
        ``touch`` is False: a look that uses nothing)."""
        tokens = np.asarray(prompt, dtype=np.int64)
        if limit is not None:
            tokens = tokens[:max(limit, 0)]
        best: PrefixMatch | None = None
        for seq_id, cached in reversed(self._entries.items()):
            n = min(len(cached), len(tokens))
            differ = np.flatnonzero(cached[:n] != tokens[:n])
            length = int(differ[0]) if differ.size else n
            if length and (best is None or length > best.length):
                best = PrefixMatch(seq_id, length, len(cached))
        if best is not None and touch:
            self._entries.move_to_end(best.seq_id)
        return best

    def insert(self, seq_id: int, tokens: Sequence[int]) -> list[int]:
        """Keep ``seq_id`` holding ``tokens``; returns the ids to free: ``seq_id`` itself when it cannot be kept
        (empty, or larger than the cache), entries it covers, and entries evicted to stay within the limits."""
        if seq_id in self._entries:
            raise ValueError(f"sequence {seq_id} is in the prefix cache already")
        new = np.asarray(tokens, dtype=np.int64).copy()
        if not len(new) or len(new) > self.max_tokens or not self.max_entries:
            return [seq_id]
        freed = [old for old, cached in self._entries.items()
                 if len(cached) <= len(new) and np.array_equal(cached, new[:len(cached)])]
        for old in freed:
            self._drop(old)
        self._entries[seq_id] = new
        self._tokens += len(new)
        while self._tokens > self.max_tokens or len(self._entries) > self.max_entries:
            freed.append(self.evict())
        return freed

    def evict(self) -> int:
        """Drop the least recently used entry and return its id (the caller frees it); ValueError when empty."""
        if not self._entries:
            raise ValueError("the prefix cache is empty: nothing to evict")
        seq_id = next(iter(self._entries))
        self._drop(seq_id)
        return seq_id

    def clear(self) -> list[int]:
        """Drop every entry; returns their ids."""
        ids = list(self._entries)
        self._entries.clear()
        self._tokens = 0
        return ids

    def _drop(self, seq_id: int) -> None:
        self._tokens -= len(self._entries.pop(seq_id))
