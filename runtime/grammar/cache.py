"""Compiled grammars cached per (engine, tokenizer, response format), shared across requests and threads.

The same schema for the same tokenizer is compiled once, even when several threads ask for it at the same moment
(one compiles, the others wait for it). A format the engine cannot compile is remembered too, so a client repeating
a bad schema gets the same error at once. Least recently used entries are dropped past ``max_entries``.

A grammar whose matcher failed mid-answer (``GrammarEngineError``) is never served again: :meth:`replace` puts the
grammar to continue with in its place (made once, however many sequences failed on it), or drops the entry when
there is none (the next request compiles the format afresh).
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
        #: Grammars dropped or replaced after one of their matchers failed (:meth:`replace`).
        self.failures = 0

    def get(self, key: tuple[str, ...], compile_fn: Callable[[], Any]) -> Any:
        while True:
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
            if owner or entry.value is not None:
                return entry.value
            # a failed grammar's entry that was being replaced, and had no replacement (dropped): compile afresh

    def replace(self, key: tuple[str, ...], failed: Any, make: Callable[[], Any | None]) -> Any | None:
        """The grammar to continue with after a matcher of ``failed`` (cached under ``key``) failed. While the
        cache holds ``failed`` (or nothing) under ``key``, ``make()`` gives it and it takes ``failed``'s place (when
        ``make()`` gives None, the entry is dropped and None returned); when another grammar is there already
        (another sequence's failure replaced it, or the format was compiled afresh), that one. Single-flight as
        :meth:`get`."""
        with self._lock:
            entry = self._entries.get(key)
            owner = entry is None or (entry.ready.is_set() and entry.error is None and entry.value is failed)
            if owner:
                entry = self._entries[key] = _Entry()
                self._entries.move_to_end(key)
                self.failures += 1
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
        assert entry is not None
        if not owner:
            entry.ready.wait()
            return entry.value if entry.error is None else None
        try:
            entry.value = make()
        except BaseException as err:
            with self._lock:
                if self._entries.get(key) is entry:
                    self._entries.pop(key)
            entry.error = GrammarError(f"the grammar could not be replaced: {type(err).__name__}: {err}")
            entry.ready.set()
            raise
        if entry.value is None:
            with self._lock:
                if self._entries.get(key) is entry:
                    self._entries.pop(key)
        entry.ready.set()
        return entry.value

    def __len__(self) -> int:
        return len(self._entries)


#: The process-wide cache used by default.
GLOBAL_CACHE = CompiledGrammarCache()
