"""The indented JSON layout (``json.dumps(value, indent=2)``) as a grammar matcher wrapped around an engine's JSON
grammar that allows any whitespace, for the engines that cannot indent by themselves (llguidance).

The layout is a small automaton over bytes, outside strings only (a string's content is the grammar's business):

* after ``{`` or ``[``: the closer at once (an empty container, ``{}``), or a newline and the indentation of the new
  depth (two spaces a level);
* after ``,``: a newline and the indentation of the depth; after ``:``: one space;
* after the last value of a container: a newline and the indentation of the container's own depth, then its closer;
* nowhere else any whitespace (none after the root value either).

:class:`JsonLayout` computes, per automaton state, which tokens keep to the layout (a bitmask row, cached per state:
a document visits a few dozen states); :class:`IndentedMatcher` applies it over the inner grammar's mask, accepts a
token only when both do, and rolls back both. The closing at ``max_tokens`` and jump-forward use the wrapped matcher,
so their plans keep to the layout too.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from .backend import GrammarMatcher
from .tokenizer_adapter import TokenizerAdapter

#: Spaces per nesting level.
INDENT = 2
#: Rows kept per tokenizer (a state is a nesting path, a position and the whitespace still due).
MAX_CACHED_STATES = 4096

WHITESPACE = frozenset(b" \n\r\t")
STRUCTURE = frozenset(b'{}[],:"\\')
QUOTE, BACKSLASH = ord('"'), ord("\\")
OPENERS = {ord("{"): ord("}"), ord("["): ord("]")}

# Modes of the automaton.
VALUE, KEY, KEY_STRING, VALUE_STRING, SCALAR, AFTER_VALUE, AFTER_KEY, OPENED, CLOSING, DONE = range(10)


class LayoutState(NamedTuple):
    """Where the layout stands: the open containers (``{`` / ``[`` bytes), the mode, the whitespace still due, and
    whether the previous byte was a backslash inside a string."""

    stack: bytes
    mode: int
    pending: bytes
    escape: bool
    after_open: bool = False  # the whitespace due follows an opener: the container's first member comes next


START = LayoutState(b"", VALUE, b"", False)
#: The bytes a value can start with (a string, a container, a number, true, false, null).
VALUE_STARTS = b'"{[-0123456789tfn'


class Probe(NamedTuple):
    """A token that keeps to the layout but commits to what follows: the inner grammar must take one of ``next``
    after it (a closer after the newline that ends a container; a key or a value after the newline that opens
    one), else the answer would reach a dead end."""

    token: int
    next: bytes


def needed_next(state: LayoutState) -> bytes:
    """What must follow a token that ends in ``state`` for the inner grammar to go on (b"": nothing to check)."""
    if state.mode == CLOSING:
        return bytes([OPENERS[state.stack[-1]]])
    if state.after_open and state.mode in (KEY, VALUE):
        return b'"' if state.mode == KEY else VALUE_STARTS
    return b""


def _newline(depth: int) -> bytes:
    return b"\n" + b" " * (INDENT * depth)


def _after_value(stack: bytes) -> LayoutState:
    return LayoutState(stack, AFTER_VALUE if stack else DONE, b"", False)


def step(state: LayoutState, byte: int) -> LayoutState | None:
    """The state after ``byte``, or None when the layout does not allow it there."""
    stack, mode, pending, escape, _ = state
    if mode in (KEY_STRING, VALUE_STRING):
        if escape:
            return LayoutState(stack, mode, pending, False)
        if byte == BACKSLASH:
            return LayoutState(stack, mode, pending, True)
        if byte == QUOTE:
            return LayoutState(stack, AFTER_KEY, b"", False) if mode == KEY_STRING else _after_value(stack)
        return state
    if pending:
        if mode == OPENED and byte == OPENERS[stack[-1]]:  # the empty container, {} or []
            return _after_value(stack[:-1])
        if byte != pending[0]:
            return None
        after_open = state.after_open or mode == OPENED
        if mode == OPENED:
            mode = KEY if stack[-1] == ord("{") else VALUE
        return LayoutState(stack, mode, pending[1:], False, after_open)
    if mode == CLOSING:
        return _after_value(stack[:-1]) if byte == OPENERS[stack[-1]] else None
    if byte in WHITESPACE:  # only the newline before a non-empty container's closer
        if byte == ord("\n") and stack and mode in (SCALAR, AFTER_VALUE):
            return LayoutState(stack, CLOSING, b" " * (INDENT * (len(stack) - 1)), False)
        return None
    if mode == KEY:
        return LayoutState(stack, KEY_STRING, b"", False) if byte == QUOTE else None
    if mode == AFTER_KEY:
        return LayoutState(stack, VALUE, b" ", False) if byte == ord(":") else None
    if mode == VALUE:
        if byte == QUOTE:
            return LayoutState(stack, VALUE_STRING, b"", False)
        if byte in OPENERS:
            inner = stack + bytes([byte])
            return LayoutState(inner, OPENED, _newline(len(inner)), False)
        return None if byte in STRUCTURE else LayoutState(stack, SCALAR, b"", False)
    if mode in (SCALAR, AFTER_VALUE):
        if byte == ord(",") and stack:
            return LayoutState(stack, KEY if stack[-1] == ord("{") else VALUE, _newline(len(stack)), False)
        if mode == SCALAR and byte not in STRUCTURE:
            return state
        return None
    return None  # DONE: nothing after the root value


def accepting(state: LayoutState) -> bool:
    """The layout is complete: the root value has ended (a root scalar may end anywhere)."""
    return state.mode == DONE or (state.mode == SCALAR and not state.stack)


def advance(state: LayoutState, text: bytes) -> LayoutState | None:
    for byte in text:
        next_state = step(state, byte)
        if next_state is None:
            return None
        state = next_state
    return state


class JsonLayout:
    """The indented layout's token rows for one tokenizer (thread-safe; rows cached per state)."""

    def __init__(self, tokenizer: TokenizerAdapter) -> None:
        self.tokenizer = tokenizer
        tokens = tokenizer.token_bytes
        self.words = (tokenizer.vocab_size + 31) // 32
        self._tokens = tokens
        self._eos = sorted(tokenizer.eos_token_ids)
        self._first = np.array([t[0] if t else -1 for t in tokens], np.int16)
        # tokens that leave a string's state unchanged (no quote, no backslash), whole or after their first byte
        self._plain = np.array([QUOTE not in t and BACKSLASH not in t for t in tokens], bool)
        self._plain_tail = np.array([QUOTE not in t[1:] and BACKSLASH not in t[1:] for t in tokens], bool)
        # tokens of scalar bytes only (a number, true, false, null, or part of one)
        self._empty = np.array([not t for t in tokens], bool)
        self._scalar = np.array([bool(t) and not (set(t) & (STRUCTURE | WHITESPACE)) for t in tokens], bool)
        self._rows: OrderedDict[LayoutState, tuple[np.ndarray, list[Probe]]] = OrderedDict()
        self._lock = threading.Lock()

    def row(self, state: LayoutState) -> tuple[np.ndarray, list[Probe]]:
        """int32 ``[ceil(V/32)]``: the tokens that keep to the layout from ``state`` (EOS where it is complete), and
        those of them that commit to what follows (checked against the inner grammar by the matcher)."""
        with self._lock:
            found = self._rows.get(state)
            if found is not None:
                self._rows.move_to_end(state)
                return found
        allowed, probes = self._allowed(state)
        packed = np.zeros(self.words * 32, bool)
        packed[:allowed.size] = allowed
        entry = np.packbits(packed, bitorder="little").view(np.int32), probes
        with self._lock:
            self._rows[state] = entry
            while len(self._rows) > MAX_CACHED_STATES:
                self._rows.popitem(last=False)
        return entry

    def _allowed(self, state: LayoutState) -> tuple[np.ndarray, list[Probe]]:
        """bool ``[len(token_bytes)]``: the whole-token check, run in Python only on the tokens that the vectorised
        classes (a string's plain bytes, a scalar's bytes, the first byte) leave open."""
        if state.mode in (KEY_STRING, VALUE_STRING):
            allowed = (self._plain_tail if state.escape else self._plain) & ~self._empty
            open_ = ~allowed & ~self._empty
        else:
            firsts = np.array([step(state, b) is not None for b in range(256)] + [False], bool)
            candidates = firsts[self._first]  # -1 (no bytes) reads the final False
            allowed = candidates & self._scalar if state.mode in (VALUE, SCALAR) and not state.pending \
                else np.zeros(len(self._tokens), bool)
            open_ = candidates & ~allowed
        probes = []
        for token in np.flatnonzero(open_):
            after = advance(state, self._tokens[token])
            allowed[token] = after is not None
            if after is not None and needed_next(after):
                probes.append(Probe(int(token), needed_next(after)))
        if accepting(state):
            allowed[[e for e in self._eos if e < allowed.size]] = True
        return allowed, probes


class IndentedMatcher(GrammarMatcher):
    """An inner JSON grammar that allows any whitespace, held to the indented layout."""

    __slots__ = ("inner", "layout", "_states", "_row", "_eos")

    def __init__(self, inner: GrammarMatcher, layout: JsonLayout) -> None:
        self.inner = inner
        self.layout = layout
        self._states = [START]
        self._row = np.empty(layout.words, np.int32)
        self._eos = frozenset(layout.tokenizer.eos_token_ids)

    @property
    def state(self) -> LayoutState:
        return self._states[-1]

    def fill_next_token_bitmask(self, row: np.ndarray) -> None:
        self.inner.fill_next_token_bitmask(row)
        layout_row, probes = self.layout.row(self.state)
        np.bitwise_and(row, layout_row, out=row)
        for token, following in probes:  # a newline that ends or opens a container: is the grammar's next byte there?
            if (int(row[token >> 5]) >> (token & 31)) & 1 and not self._goes_on(token, following):
                words = row.view(np.uint32)
                words[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)

    def _goes_on(self, token: int, following: bytes) -> bool:
        """Whether the inner grammar takes ``token`` and then one of the bytes ``following``; its state unchanged."""
        if not self.inner.try_accept_token(token):
            return False
        singles = self.layout.tokenizer.byte_tokens
        try:
            for byte in following:
                if byte in singles and self.inner.try_accept_token(singles[byte]):
                    self.inner.rollback(1)
                    return True
            return False
        finally:
            self.inner.rollback(1)

    def try_accept_token(self, token_id: int) -> bool:
        token = int(token_id)
        if token in self._eos:
            after: LayoutState | None = self.state if accepting(self.state) else None
        else:
            after = advance(self.state, self.layout.tokenizer.token_bytes[token]) \
                if token < len(self.layout.tokenizer.token_bytes) else None
        if after is None or not self.inner.try_accept_token(token):
            return False
        self._states.append(after)
        return True

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)
        if num_tokens:
            del self._states[-num_tokens:]

    def is_accepting(self) -> bool:
        return self.inner.is_accepting() and accepting(self.state)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def closing_bytes(self) -> bytes:
        return b'"}]\n'  # a non-empty container closes on a new line

    def forced_bytes(self) -> bytes:
        """The whitespace the layout requires now (unless a container may close empty), else the inner grammar's
        forced bytes as far as the layout allows them."""
        state = self.state
        if state.pending and state.mode != OPENED:
            return state.pending
        out = bytearray()
        for byte in self.inner.forced_bytes():
            next_state = step(state, byte)
            if next_state is None:
                break
            out.append(byte)
            state = next_state
        return bytes(out)
