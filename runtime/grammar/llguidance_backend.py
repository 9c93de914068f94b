"""The llguidance engine (default; MIT, no dependencies): Earley parser over a lexer, masks computed on demand.

Compiling a response format gives a pristine ``LLMatcher`` (grammar parsed and checked once); every sequence gets a
``deep_copy`` of it. A token is validated before it is consumed, because a refused ``consume_token`` leaves an
llguidance matcher in a permanent error state.
"""

from __future__ import annotations

import threading
from typing import Any

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

from ..response_format import ResponseFormat
from .backend import GrammarBackend, GrammarError, GrammarMatcher
from .tokenizer_adapter import TokenizerAdapter

#: JSON layout: any whitespace between tokens, as vLLM's default, but at most this many characters in a row, so that
#: a sampled output cannot spin in whitespace.
MAX_JSON_WHITESPACE = 16


def first_line(error: str | None) -> str:
    """llguidance's error without the parser state it appends (a dump of 20-odd lines)."""
    return (error or "unknown error").strip().splitlines()[0] if (error or "").strip() else "unknown error"


def json_options() -> dict[str, Any]:
    return {"whitespace_flexible": True, "whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{0,{MAX_JSON_WHITESPACE}}}"}


class LLGuidanceMatcher(GrammarMatcher):
    __slots__ = ("_m", "_adapter", "_eos")

    def __init__(self, matcher: llguidance.LLMatcher, adapter: TokenizerAdapter) -> None:
        self._m = matcher
        self._adapter = adapter
        self._eos = frozenset(adapter.eos_token_ids)

    def fill_next_token_bitmask(self, row: np.ndarray) -> None:
        if self._m.is_error():  # llguidance would allow EOS alone: an error must not pass for a finished answer
            raise GrammarError(f"llguidance matcher failed: {first_line(self._m.get_error())}")
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if self._m.is_error():
            raise GrammarError(f"llguidance matcher failed: {first_line(self._m.get_error())}")
        self._adapter.clear_padding(row)

    def try_accept_token(self, token_id: int) -> bool:
        token = int(token_id)
        if token in self._eos:  # validate_tokens never counts EOS; it is taken exactly where the grammar accepts
            return self._m.is_accepting() and not self._m.is_error() and bool(self._m.consume_token(token))
        if self._m.validate_tokens([token]) != 1:
            return False
        return bool(self._m.consume_token(token))

    def try_accept_tokens(self, token_ids: list[int]) -> int:
        ids = [int(t) for t in token_ids]
        if self._eos.intersection(ids):
            return super().try_accept_tokens(ids)
        count = self._m.validate_tokens(ids)
        if count and not self._m.consume_tokens(ids[:count]):
            raise GrammarError(f"llguidance refused tokens it had validated: {first_line(self._m.get_error())}")
        return count

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self._m.rollback(num_tokens):
            raise GrammarError(f"llguidance cannot roll back {num_tokens} tokens: {first_line(self._m.get_error())}")

    def is_accepting(self) -> bool:
        return self._m.is_accepting()

    def is_terminated(self) -> bool:
        return self._m.is_stopped()

    def forced_bytes(self) -> bytes:
        return bytes(self._m.compute_ff_bytes())


class LLGuidanceBackend(GrammarBackend):
    """llguidance over the adapter's tokenizer (its JSON), the model's vocabulary size and EOS ids."""

    name = "llguidance"

    def __init__(self, tokenizer: TokenizerAdapter) -> None:
        super().__init__(tokenizer)
        self.lltokenizer = llguidance.LLTokenizer(tokenizer.json, n_vocab=tokenizer.vocab_size,
                                                  eos_token=list(tokenizer.eos_token_ids))
        self._lock = threading.Lock()

    def grammar_text(self, fmt: ResponseFormat) -> str:
        if fmt.kind in ("json_object", "json_schema"):
            return llguidance.LLMatcher.grammar_from_json_schema(fmt.text, overrides=json_options())
        if fmt.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(fmt.text)
        lark = fmt.text if fmt.syntax == "lark" else gbnf_to_lark(fmt.text)
        return llguidance.LLMatcher.grammar_from_lark(lark)

    def compile(self, response_format: ResponseFormat) -> llguidance.LLMatcher:
        try:
            grammar = self.grammar_text(response_format)
        except Exception as err:  # the converters raise ValueError or their own errors
            raise GrammarError(f"llguidance cannot read this {response_format.kind}: {err}") from None
        matcher = llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"llguidance cannot compile this {response_format.kind}: "
                               f"{first_line(matcher.get_error())}")
        self._probe(matcher, response_format)
        return matcher

    def _probe(self, compiled: llguidance.LLMatcher, response_format: ResponseFormat) -> None:
        """Refuse, before any request starts, a grammar no output can satisfy (no first token and nothing to accept)
        or one whose first token already breaks llguidance's limits (``a{1000000}``): the first mask, and its
        first token consumed, on a copy. Compiled grammars are cached, so this runs once per grammar."""
        probe = compiled.deep_copy()
        row = np.zeros((self.tokenizer.vocab_size + 31) // 32, np.int32)
        probe.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        self.tokenizer.clear_padding(row)
        what = f"this {response_format.kind}"
        if probe.is_error():
            raise GrammarError(f"llguidance cannot use {what}: {first_line(probe.get_error())}")
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
        if not allowed.size:
            if not probe.is_accepting():
                raise GrammarError(f"{what} can never be satisfied: no text matches it")
            return
        if not probe.consume_token(int(allowed[0])) or probe.is_error():
            raise GrammarError(f"llguidance cannot use {what}: {first_line(probe.get_error())} (its limits; "
                               "write the pattern with fewer repetitions)")

    def matcher(self, compiled: llguidance.LLMatcher) -> LLGuidanceMatcher:
        with self._lock:
            copy = compiled.deep_copy()
        return LLGuidanceMatcher(copy, self.tokenizer)

