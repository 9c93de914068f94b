"""The grammar engine interface: one ``GrammarBackend`` per engine (llguidance, xgrammar), one matcher per sequence.

A backend compiles a :class:`~logitproc.runtime.response_format.ResponseFormat` for a tokenizer into an opaque
compiled grammar (thread-safe, shared by every sequence using it) and makes matchers from it. A matcher follows one
sequence: it fills bitmask rows (int32 words, bit ``v % 32`` of word ``v // 32`` = token v allowed; ids past the
tokenizer's size and special tokens other than EOS never allowed; EOS allowed only where the grammar accepts),
consumes tokens, rolls back, and tells the bytes the grammar forces next (for jump-forward).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..response_format import ResponseFormat
from .tokenizer_adapter import TokenizerAdapter


class GrammarError(ValueError):
    """A response format the engine cannot compile, or a token the grammar refuses: an error for one request."""


class GrammarEngineError(GrammarError):
    """The engine itself failed while following a sequence (not a refusal of a token: e.g. llguidance's lexer out of
    its limits): the matcher, and every matcher of its compiled grammar, can no longer be used."""


class GrammarMatcher(ABC):
    """The grammar state of one sequence."""

    @abstractmethod
    def fill_next_token_bitmask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into ``row`` (int32 ``[ceil(V/32)]``)."""

    @abstractmethod
    def try_accept_token(self, token_id: int) -> bool:
        """Consume one token; False (state unchanged) when the grammar does not allow it."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def is_accepting(self) -> bool:
        """The output so far is a complete match (EOS is allowed now)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """EOS has been consumed, or the grammar allows nothing but EOS."""

    @abstractmethod
    def forced_bytes(self) -> bytes:
        """The bytes every continuation starts with (b"" when the next byte is not determined)."""

    def closing_bytes(self) -> bytes:
        """Bytes the completion search (``closing.py``) tries first, before its usual order of preference: b""
        unless a layout closes structures with more than their closers (the indented layout's newline)."""
        return b""

    def try_accept_tokens(self, token_ids: Sequence[int]) -> int:
        """Consume tokens in order until one is refused; the number consumed."""
        for count, token in enumerate(token_ids):
            if not self.try_accept_token(token):
                return count
        return len(token_ids)


class GrammarBackend(ABC):
    """A grammar engine bound to one tokenizer."""

    name: str = ""

    def __init__(self, tokenizer: TokenizerAdapter) -> None:
        self.tokenizer = tokenizer

    @property
    def cache_name(self) -> str:
        """The engine's part of a compiled grammar's cache key: its name, and any setting that changes what it
        compiles."""
        return self.name

    @abstractmethod
    def compile(self, response_format: ResponseFormat) -> Any:
        """The compiled grammar (shared, read-only); GrammarError when the engine cannot compile it."""

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar."""

    def after_failure(self, response_format: ResponseFormat, failed: Any, error: GrammarEngineError) -> Any | None:
        """The grammar to continue with once a matcher of ``failed`` (compiled for ``response_format``) raised
        ``error``: the next step of the engine's recovery ladder, each step accepting every document the one before
        accepts (``grammar/recovery.py``); None when no step is left (the request then ends with the error)."""
        return None

    def relaxed_keywords(self, compiled: Any) -> tuple[str, ...]:
        """The schema keywords the compiled grammar does not enforce (it was compiled relaxed: only validating
        keywords the engine does not implement, checked on the finished answer instead); () when it is exact."""
        return ()
