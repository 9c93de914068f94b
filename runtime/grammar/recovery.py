"""Recovery from a grammar engine failing mid-answer: the sequence goes on with the engine's next grammar, its tokens
replayed.

A grammar engine can fail while it follows an answer, for reasons of its own rather than the answer's (llguidance's
lexer running out of its per-step limits inside a large schema: "too many expressions constructed"); such a matcher,
and with llguidance every matcher of the same compiled grammar, is of no more use. A :class:`RecoveringMatcher`
holds the engine's matcher of one sequence and every token it has accepted. When the engine raises
:class:`GrammarEngineError`, it asks the factory's ``replacement`` (the grammar cache's :meth:`replace
<logitproc.runtime.grammar.cache.CompiledGrammarCache.replace>` over the backend's :meth:`after_failure
<logitproc.runtime.grammar.backend.GrammarBackend.after_failure>`) for the grammar to continue with: the failed one
leaves the cache, its replacement takes its place for later requests, and each step of the ladder accepts every
document the step before accepts (so the tokens accepted so far are accepted again). The tokens are replayed into a
fresh matcher of it and the call that failed is made again. What the new grammar no longer enforces is in
:attr:`RecoveringMatcher.relaxed_keywords` (the finished answer is validated against the whole schema anyway).

Why continue rather than end the request: the tokens written so far are valid under the original grammar, and a
user asking for a JSON schema expects a document; ending with an error would throw away a correct prefix because of
an engine limit. Only when the ladder has no step left (or after ``MAX_RECOVERIES``) does the call raise
:class:`GrammarEngineError` for good, naming the engine's failure, and the sequence ends with finish reason "error"
(never unconstrained).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .backend import GrammarBackend, GrammarEngineError, GrammarMatcher

#: Recoveries one sequence may make (each moves at least one step down a finite ladder; a bound all the same).
MAX_RECOVERIES = 6


class RecoveringMatcher(GrammarMatcher):
    """An engine's matcher that continues on a replacement grammar when the engine fails (see the module doc)."""

    __slots__ = ("backend", "compiled", "inner", "history", "recovered", "_replacement", "_describe")

    def __init__(self, backend: GrammarBackend, compiled: Any, replacement: Callable[[Any, GrammarEngineError], Any],
                 describe: Callable[[tuple[str, ...]], tuple[str, ...]] | None = None) -> None:
        """``replacement(failed, error)``: the grammar to continue with after a matcher of ``failed`` raised
        ``error``, or None; ``describe``: maps the backend's relaxed keywords to those reported (e.g.
        ``uniqueItems`` replaced by what the unique-items wrapper leaves unenforced)."""
        self.backend = backend
        self.compiled = compiled
        self.inner = backend.matcher(compiled)
        #: The tokens the matcher has accepted (replayed into a replacement's matcher).
        self.history: list[int] = []
        #: The engine failures this sequence recovered from.
        self.recovered: list[str] = []
        self._replacement = replacement
        self._describe = describe

    @property
    def relaxed_keywords(self) -> tuple[str, ...]:
        """What the grammar now followed does not enforce (grows when a recovery relaxed the format)."""
        relaxed = self.backend.relaxed_keywords(self.compiled)
        return self._describe(relaxed) if self._describe is not None else relaxed

    def _recover(self, error: GrammarEngineError) -> None:
        """Continue on the replacement of the current grammar, the accepted tokens replayed; the final
        GrammarEngineError when there is none."""
        while True:
            if len(self.recovered) >= MAX_RECOVERIES:
                raise GrammarEngineError(f"the grammar engine failed mid-answer ({error}), {len(self.recovered)} "
                                         "times: the answer cannot go on under its response format") from error
            self.recovered.append(str(error))
            compiled = self._replacement(self.compiled, error)
            if compiled is None:
                raise GrammarEngineError(f"the grammar engine failed mid-answer ({error}) and no relaxation of the "
                                         "response format is left: the answer cannot go on under it") from error
            matcher = self.backend.matcher(compiled)
            try:
                replayed = matcher.try_accept_tokens(self.history)
            except GrammarEngineError as again:
                self.compiled, error = compiled, again
                continue
            if replayed != len(self.history):
                raise GrammarEngineError(f"the grammar engine failed mid-answer ({error}) and its relaxed grammar "
                                         f"refuses the answer so far at token {replayed}") from error
            self.compiled, self.inner = compiled, matcher
            return

    # ---- GrammarMatcher: each call made again on the replacement when the engine fails -----------------------------
    def fill_next_token_bitmask(self, row: np.ndarray) -> None:
        while True:
            try:
                self.inner.fill_next_token_bitmask(row)
                return
            except GrammarEngineError as err:
                self._recover(err)

    def try_accept_token(self, token_id: int) -> bool:
        while True:
            try:
                accepted = self.inner.try_accept_token(token_id)
                break
            except GrammarEngineError as err:
                self._recover(err)
        if accepted:
            self.history.append(int(token_id))
        return accepted

    def try_accept_tokens(self, token_ids: Sequence[int]) -> int:
        while True:
            try:
                count = self.inner.try_accept_tokens(token_ids)
                break
            except GrammarEngineError as err:  # the tokens taken before the failure are undone first
                self._recover(err)
        self.history.extend(int(t) for t in token_ids[:count])
        return count

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)
        if num_tokens:
            del self.history[len(self.history) - num_tokens:]

    def is_accepting(self) -> bool:
        return self.inner.is_accepting()

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def forced_bytes(self) -> bytes:
        while True:
            try:
                return self.inner.forced_bytes()
            except GrammarEngineError as err:
                self._recover(err)

    def closing_bytes(self) -> bytes:
        return self.inner.closing_bytes()
