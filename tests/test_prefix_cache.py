"""The prefix cache's index: longest-prefix matches, covered entries dropped, LRU eviction, limits and bad input."""

from __future__ import annotations

import pytest
from logitproc.serve.prefix_cache import PrefixCache, PrefixMatch


def test_longest_shared_prefix_wins_and_limit_caps_it():
    cache = PrefixCache(max_tokens=100, max_entries=8)
    assert cache.insert(1, [5, 6, 7, 8]) == []
    assert cache.insert(2, [5, 6, 9]) == []
    assert cache.match([5, 6, 7, 8, 10]) == PrefixMatch(1, 4, 4)
    assert cache.match([5, 6, 9, 9]) == PrefixMatch(2, 3, 3)
    assert cache.match([5, 6, 7, 8], limit=3) == PrefixMatch(1, 3, 4)  # one token left to prefill
    assert cache.match([5, 7]) in (PrefixMatch(1, 1, 4), PrefixMatch(2, 1, 3))
    assert cache.match([4, 5, 6]) is None
    assert cache.match([]) is None
    assert cache.match([5], limit=0) is None


def test_ties_go_to_the_most_recently_used():
    cache = PrefixCache(max_tokens=100, max_entries=8)
    cache.insert(1, [1, 2, 3])
    cache.insert(2, [1, 2, 4])
    assert cache.match([1, 2, 9]).seq_id == 2
    cache.match([1, 2, 3])  # entry 1 used last
    assert cache.match([1, 2, 9]).seq_id == 1


def test_an_entry_covered_by_a_newer_one_is_freed():
    cache = PrefixCache(max_tokens=100, max_entries=8)
    cache.insert(1, [1, 2, 3])                       # turn one
    cache.insert(3, [7, 7])
    assert cache.insert(2, [1, 2, 3, 4, 5]) == [1]   # turn two extends it
    assert 1 not in cache and 2 in cache and len(cache) == 2
    assert cache.num_tokens == 7
    assert cache.insert(4, [1, 2]) == []             # a shorter one is kept: it is not covered by an older entry


def test_lru_eviction_by_tokens_and_entries():
    cache = PrefixCache(max_tokens=10, max_entries=3)
    cache.insert(1, [1] * 4)
    cache.insert(2, [2] * 4)
    cache.match([1, 1])                               # 1 is now the most recent
    assert cache.insert(3, [3] * 4) == [2]            # 12 tokens > 10: the least recently used goes
    assert sorted(cache.clear()) == [1, 3] and cache.num_tokens == 0
    small = PrefixCache(max_tokens=100, max_entries=2)
    small.insert(1, [1])
    small.insert(2, [2])
    assert small.insert(3, [3]) == [1]
    assert small.evict() == 2 and small.evict() == 3
    with pytest.raises(ValueError, match="empty"):
        small.evict()


def test_entries_that_cannot_be_kept_are_handed_back():
    cache = PrefixCache(max_tokens=3, max_entries=2)
    assert cache.insert(1, []) == [1]
    assert cache.insert(2, [1, 2, 3, 4]) == [2]
    assert PrefixCache(max_tokens=10, max_entries=0).insert(5, [1]) == [5]
    cache.insert(3, [1])
    with pytest.raises(ValueError, match="already"):
        cache.insert(3, [2])


@pytest.mark.parametrize(("field", "value"), [("max_tokens", -1), ("max_tokens", 1.5), ("max_entries", True),
                                              ("max_entries", -2)])
def test_bad_limits_are_refused(field, value):
    kwargs = {"max_tokens": 10, "max_entries": 2, field: value}
    with pytest.raises(ValueError, match=field):
        PrefixCache(**kwargs)
