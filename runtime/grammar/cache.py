"""Compiled grammars cached per (engine, tokenizer, response format), shared across requests and threads.

The same schema for the same tokenizer is compiled once, even when several threads ask for it at the same moment
(one compiles, the others wait for it). A format the engine cannot compile is remembered too, so a client repeating
a bad schema gets the same error at once. Least recently used entries are dropped past ``max_entries``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from .backend import GrammarError


class _Entry:
    __slots__ = ("ready", "value", "error")

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.value: Any = None
        self.error: GrammarError | None = None


class CompiledGrammarCache:
    """A thread-safe LRU of compiled grammars with single-flight compilation."""

    def __init__(self, max_entries: int = 256) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, ...], _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.compiles = 0

    def get(self, key: tuple[str, ...], compile_fn: Callable[[], Any]) -> Any:
        with self._lock:
            entry = self._entries.get(key)
            owner = entry is None
            if owner:
                entry = self._entries[key] = _Entry()
                self.compiles += 1
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
            else:
                self._entries.move_to_end(key)
                self.hits += 1
        assert entry is not None
        if owner:
            try:
                entry.value = compile_fn()
            except GrammarError as err:
                entry.error = err
            except BaseException:
                with self._lock:  # an unexpected failure is not cached
                    self._entries.pop(key, None)
                entry.error = GrammarError("grammar compilation failed in another thread")
                entry.ready.set()
                raise
            entry.ready.set()
        else:
            entry.ready.wait()
        if entry.error is not None:
            raise GrammarError(str(entry.error))
        return entry.value

    def __len__(self) -> int:
        return len(self._entries)


#: The process-wide cache used by default.
GLOBAL_CACHE = CompiledGrammarCache()
