"""``uniqueItems`` while generating: a grammar matcher wrapped around the engine's, which forbids the tokens that
would complete an item equal to an earlier item of the same array (arrays of strings, numbers, booleans, null and
their enums; objects and arrays as items are compared only on the finished answer).

No grammar engine enforces ``uniqueItems`` (an array's items would need unbounded memory). This wrapper follows the
document's bytes with a small JSON automaton (:func:`advance`) that keeps, for each open array whose schema
requires unique items (``unique_positions.SchemaPositions``), the comparison keys of its scalar items so far
(strings by their code points after unescaping, numbers by value: ``1``, ``1.0`` and ``1e0`` are equal, booleans,
null). An item is complete at its closing quote (a string) or at the byte after it (a number, ``true``, ``false``,
``null``: the separator, the closing bracket or whitespace); a token whose bytes complete a duplicate is refused.
So that a sequence never walks into a dead end, a token is also refused when the item it starts or extends can
only end as a duplicate: a ``t`` when ``true`` is used, a prefix of an enum whose remaining values are all used, a
``,`` when every value of a finite set (an enum, booleans) is used.

:class:`UniqueItemsMatcher` applies this over the inner matcher's mask: only the tokens that could complete or start
an item are walked (those holding a quote inside a string; outside strings, all but purely numeric tokens; every
allowed token where an item's values are finite), a token is accepted only when both accept it, and rollback undoes
both. The closing at ``max_tokens`` and jump-forward go through the wrapped matcher, so their plans keep the items
unique. Where the filter would leave no token that the grammar allows (a string pattern or a bound that admits only
used values), it yields for that position (``yielded`` counts it) and the answer's validation reports the duplicate.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from .backend import GrammarMatcher
from .tokenizer_adapter import TokenizerAdapter
from .unique_positions import (
    ANYTHING,
    Position,
    SchemaPositions,
    ValueKey,
    double_key,
    number_key,
    unenforced_unique_items,
)

WHITESPACE = frozenset(b" \n\r\t")
QUOTE, BACKSLASH, COMMA = ord('"'), ord("\\"), ord(",")
#: Bytes that end a number or a literal.
SCALAR_END = frozenset(b",]} \n\r\t")
LITERALS = {ord("t"): (b"true", ("b", True)), ord("f"): (b"false", ("b", False)), ord("n"): (b"null", ("z",))}
NUMERIC = frozenset(b"0123456789+-.")
#: A number whose digits are all zero, in its exponent: it stays 0.
ZERO_EXPONENT = re.compile(rb"-?0(\.0*)?[eE][+-]?\d*")
#: The lookahead of an item that may only end as a duplicate: bytes tried (closers first), tries and depth.
STRING_SEARCH = b'"' + bytes(range(ord("a"), ord("z") + 1)) + b"0123456789" + bytes(range(ord("A"), ord("Z") + 1)) \
    + b" -_.,:;/@#"
SCALAR_SEARCH = b",]} 123456789.0eE+-"  # 0 late: "0.000..." is the longest way to nowhere
LOOKAHEAD_TRIES = 256
#: Numbers are spelled without an exponent only up to this many zeros (lookahead spellings of earlier items).
PLAIN_DIGITS = 64
LOOKAHEAD_DEPTH = 32
#: Bytes after a string's closing quote that never start a value (their effect does not depend on the string).
SIMPLE_TAIL = frozenset(b",]}: \n\r\t")

# Modes of the automaton.
VALUE, ARRAY_FIRST, OBJECT_FIRST, KEY, COLON, AFTER, STRING, KEY_STRING, SCALAR, DONE, LOST = range(11)


class Frame(NamedTuple):
    """An open container: its schema position; an object's current key, or an array's item index, whether its items
    must be unique and the keys of its scalar items so far."""

    is_array: bool
    position: Position
    key: str | None = None
    index: int = 0
    unique: bool = False
    seen: frozenset = frozenset()


class TrackState(NamedTuple):
    """Where the document stands: the open containers, the mode, the bytes of the current string or scalar (None
    when it needs no comparison), and whether the previous byte was a backslash inside a string."""

    stack: tuple[Frame, ...]
    mode: int
    text: bytes | None = None
    escape: bool = False


START = TrackState((), VALUE)
LOST_STATE = TrackState((), LOST)


def _decode_string(raw: bytes) -> str | None:
    if BACKSLASH not in raw:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return None
    try:
        value = json.loads(b'"' + raw + b'"')
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _decode_prefix(raw: bytes) -> str:
    """The code points of a string's first bytes, without a trailing incomplete escape or UTF-8 sequence."""
    for cut in range(min(len(raw), 6) + 1):  # an escape is at most 6 bytes, a UTF-8 sequence 4
        decoded = _decode_string(raw[: len(raw) - cut])
        if decoded is not None:
            return decoded
    return ""


def _scalar_key(text: bytes) -> ValueKey | None:
    if text in (b"true", b"false", b"null"):
        return LITERALS[text[0]][1]
    try:
        return number_key(text.decode("ascii"))
    except UnicodeDecodeError:
        return None


def _scalar_spellings(key: ValueKey) -> tuple[bytes, ...]:
    """How a scalar of a finite set, or an earlier item, may be written: its JSON text (a number's plain digits and
    exponent form; integral numbers also as ``N.0``)."""
    if key[0] == "b":
        return (b"true" if key[1] else b"false",)
    if key[0] == "z":
        return (b"null",)
    if key[0] != "n":
        return ()
    _, sign, digits, exponent = key
    if digits == "0":
        return (b"0", b"0.0", b"-0")
    out = {f"{sign}{digits}e{exponent}".encode()}
    if abs(exponent) > PLAIN_DIGITS:  # only the exponent form (a model that writes 1e999999 gets no lookahead)
        return tuple(out)
    if exponent >= 0:
        whole = f"{sign}{digits}{'0' * exponent}"
        out |= {whole.encode(), f"{whole}.0".encode()}
    elif -exponent < len(digits):
        out.add(f"{sign}{digits[:exponent]}.{digits[exponent:]}".encode())
    else:
        out.add(f"{sign}0.{'0' * (-exponent - len(digits))}{digits}".encode())
    return tuple(out)


def _spellings(key: ValueKey) -> tuple[bytes, ...]:
    """How an item equal to ``key`` starts: a string's quote and its plain UTF-8 text, a number's spellings (literals:
    none, the automaton handles them)."""
    if key[0] == "s":
        return (b'"' + key[1].encode("utf-8", "surrogatepass"),)
    return _scalar_spellings(key) if key[0] == "n" else ()


class UniqueItems:
    """The comparison rules of one schema: which arrays need unique items, and each item's finite values."""

    def __init__(self, positions: SchemaPositions) -> None:
        self.positions = positions
        #: What of the schema's ``uniqueItems`` is not enforced while generating (None: all of it).
        self.unenforced = unenforced_unique_items(positions)

    def relaxed_keywords(self, relaxed: tuple[str, ...]) -> tuple[str, ...]:
        """A grammar's relaxed keywords with ``uniqueItems`` replaced by what the generation leaves unenforced (also
        where the engine compiled the schema without naming it: no engine enforces ``uniqueItems``)."""
        rest = [k for k in relaxed if k != "uniqueItems"]
        return tuple(sorted(rest + ([self.unenforced] if self.unenforced else [])))

    def value_position(self, state: TrackState) -> Position:
        if not state.stack:
            return self.positions.root
        top = state.stack[-1]
        if top.is_array:
            return self.positions.child_index(top.position, top.index)
        return self.positions.child_key(top.position, top.key) if top.key is not None else ANYTHING

    def item_values(self, frame: Frame) -> frozenset | None:
        """The unused keys of the finite values of the array's current item (None: unbounded)."""
        finite = self.positions.child_index(frame.position, frame.index).finite
        return None if finite is None else finite - frame.seen

    # ---- the automaton ---------------------------------------------------------------------------------------------
    def advance(self, state: TrackState, data: bytes, check: bool = True) -> TrackState | None:
        """The state after ``data``, or None when it completes a duplicate or leaves only duplicates (``check``);
        a byte the automaton does not expect (never, below a JSON grammar) makes it stop comparing (``LOST``)."""
        for byte in data:
            next_state = self.step(state, byte, check)
            if next_state is None:
                return None
            state = next_state
        return state

    def _unique_item(self, state: TrackState) -> bool:
        return bool(state.stack) and state.stack[-1].is_array and state.stack[-1].unique

    def _complete(self, state: TrackState, key: ValueKey | None, check: bool) -> TrackState | None:
        """The value just ended: recorded in its array (None when it is a duplicate)."""
        stack = state.stack
        if not stack:
            return TrackState((), DONE)
        top = stack[-1]
        if top.is_array and top.unique and key is not None:
            keys = {key}
            if key[0] == "n" and state.text is not None:
                keys.add(double_key(state.text.decode("ascii")))
            if check and not top.seen.isdisjoint(keys):
                return None
            top = top._replace(seen=top.seen | keys)
        return TrackState(stack[:-1] + (top,), AFTER)

    def _viable(self, state: TrackState) -> bool:
        """Whether the item being written can still end as a value not used yet."""
        if not self._unique_item(state) or state.text is None:
            return True
        top = state.stack[-1]
        if state.mode == SCALAR and state.text[:1] and state.text[0] in LITERALS:
            literal, key = LITERALS[state.text[0]]
            if key in top.seen and literal.startswith(state.text):
                return False
        if state.mode == SCALAR and ZERO_EXPONENT.fullmatch(state.text) and number_key("0") in top.seen:
            return False  # 0e..., -0.00E+...: zero whatever the exponent, and 0 is there already
        unused = self.item_values(top)
        if unused is None:
            return True
        if state.mode == STRING:
            prefix = _decode_prefix(state.text)
            return any(k[0] == "s" and k[1].startswith(prefix) for k in unused)
        return any(s.startswith(state.text) for k in unused for s in _scalar_spellings(k))

    def step(self, state: TrackState, byte: int, check: bool = True) -> TrackState | None:
        mode = state.mode
        if mode == LOST:
            return state
        if mode in (STRING, KEY_STRING):
            if state.escape or byte not in (QUOTE, BACKSLASH):
                text = None if state.text is None else state.text + bytes([byte])
                out = TrackState(state.stack, mode, text, False)
                return out if not check or mode == KEY_STRING or self._viable(out) else None
            if byte == BACKSLASH:
                text = None if state.text is None else state.text + b"\\"
                return TrackState(state.stack, mode, text, True)
            if mode == KEY_STRING:  # the key is known: the value's position follows from it
                key = _decode_string(state.text or b"")
                top = state.stack[-1]._replace(key=key)
                return TrackState(state.stack[:-1] + (top,), COLON)
            value = _decode_string(state.text) if state.text is not None else None
            return self._complete(state, None if value is None else ("s", value), check)
        if mode == SCALAR:
            if byte not in SCALAR_END:
                out = TrackState(state.stack, SCALAR, None if state.text is None else state.text + bytes([byte]))
                return out if not check or self._viable(out) else None
            done = self._complete(state, None if state.text is None else _scalar_key(state.text), check)
            if done is None:
                return None
            state, mode = done, done.mode
        if byte in WHITESPACE:
            return state
        stack = state.stack
        if mode in (VALUE, ARRAY_FIRST):
            if mode == ARRAY_FIRST and byte == ord("]"):
                return self._complete(TrackState(stack[:-1], AFTER), None, check)
            if byte == ord("{"):
                return TrackState(stack + (Frame(False, self.value_position(state)),), OBJECT_FIRST)
            if byte == ord("["):
                position = self.value_position(state)
                return TrackState(stack + (Frame(True, position, unique=position.unique),), ARRAY_FIRST)
            tracked = self._unique_item(state)
            if byte == QUOTE:
                out = TrackState(stack, STRING, b"" if tracked else None)
                return out if not check or self._viable(out) else None
            out = TrackState(stack, SCALAR, bytes([byte]) if tracked else None)
            return out if not check or self._viable(out) else None
        if mode in (OBJECT_FIRST, KEY):
            if mode == OBJECT_FIRST and byte == ord("}"):
                return self._complete(TrackState(stack[:-1], AFTER), None, check)
            return TrackState(stack, KEY_STRING, b"") if byte == QUOTE else LOST_STATE
        if mode == COLON:
            return TrackState(stack, VALUE) if byte == ord(":") else LOST_STATE
        if mode == AFTER and stack:
            top = stack[-1]
            if byte == COMMA:
                if top.is_array:
                    top = top._replace(index=top.index + 1)
                    if check and top.unique and self.item_values(top) == frozenset():
                        return None  # every value of the item's finite set is used: no further item can be unique
                    return TrackState(stack[:-1] + (top,), VALUE)
                return TrackState(stack[:-1] + (top._replace(key=None),), KEY)
            if byte == (ord("]") if top.is_array else ord("}")):
                return self._complete(TrackState(stack[:-1], AFTER), None, check)
        return LOST_STATE


class UniqueItemsTokens:
    """Per tokenizer: which tokens the wrapper walks in each situation (packed rows), and their bytes."""

    def __init__(self, tokenizer: TokenizerAdapter) -> None:
        self.tokenizer = tokenizer
        self.words = (tokenizer.vocab_size + 31) // 32
        tokens = tokenizer.token_bytes

        def packed(flags: list[bool]) -> np.ndarray:
            bits = np.zeros(self.words * 32, bool)
            bits[: len(flags)] = flags
            return np.packbits(bits, bitorder="little").view(np.int32)

        #: tokens holding a quote (inside a string, only they can end it)
        self.quote = packed([QUOTE in t for t in tokens])
        #: tokens that are not purely numeric (outside strings, only they can end an item or start a literal)
        self.structural = packed([bool(t) and not set(t) <= NUMERIC for t in tokens])
        #: the same without the tokens that open a string and stay in it (``"abc``: they complete nothing), for a
        #: value position whose values are unbounded
        self.value_start = packed([bool(t) and not set(t) <= NUMERIC and not (
            t[:1] == b'"' and QUOTE not in t[1:] and BACKSLASH not in t) for t in tokens])
        #: tokens holding an opening bracket (with no array that needs unique items open, only they can open one)
        self.bracket = packed([ord("[") in t for t in tokens])
        #: the first id of each token text (the tokens that spell the rest of an earlier item are looked up here)
        self.by_bytes: dict[bytes, int] = {}
        for token, text in enumerate(tokens):
            if text:
                self.by_bytes.setdefault(text, token)
        #: quote tokens that end a string simply: (the bytes before the quote, no backslash; the bytes after it,
        #: only ``SIMPLE_TAIL``), by id
        self.string_end: dict[int, tuple[bytes, bytes]] = {}
        for token, text in enumerate(tokens):
            head, quote, tail = text.partition(b'"')
            if quote and BACKSLASH not in head and set(tail) <= SIMPLE_TAIL:
                self.string_end[token] = (head, tail)


class UniqueItemsMatcher(GrammarMatcher):
    """An inner grammar matcher whose arrays keep their scalar items unique (see the module doc)."""

    __slots__ = ("inner", "rules", "tokens", "_states", "_yield_at", "yielded", "_eos")

    def __init__(self, inner: GrammarMatcher, rules: UniqueItems, tokens: UniqueItemsTokens) -> None:
        self.inner = inner
        self.rules = rules
        self.tokens = tokens
        self._states = [START]
        self._yield_at = -1  # the position (tokens accepted) where the filter yielded to the grammar
        #: Positions where no token the grammar allows kept the items unique (the grammar's mask was used).
        self.yielded = 0
        self._eos = frozenset(tokens.tokenizer.eos_token_ids)

    @property
    def state(self) -> TrackState:
        return self._states[-1]

    def _walked(self, state: TrackState) -> np.ndarray | None:
        """The packed row of tokens to walk from ``state`` (None: every allowed token)."""
        if not any(frame.unique for frame in state.stack):
            return self.tokens.bracket
        if state.mode in (STRING, KEY_STRING):
            finite = state.mode == STRING and self.rules._unique_item(state) and \
                self.rules.item_values(state.stack[-1]) is not None
            return None if finite else self.tokens.quote
        if state.mode in (VALUE, ARRAY_FIRST, SCALAR) and self.rules._unique_item(state) and \
                self.rules.item_values(state.stack[-1]) is not None:
            return None
        return self.tokens.value_start if state.mode in (VALUE, ARRAY_FIRST) else self.tokens.structural

    def fill_next_token_bitmask(self, row: np.ndarray) -> None:
        self.inner.fill_next_token_bitmask(row)
        state = self.state
        if state.mode in (DONE, LOST):
            return
        walked = self._walked(state)
        candidates = row if walked is None else row & walked
        words = np.flatnonzero(candidates)
        token_bytes = self.tokens.tokenizer.token_bytes
        ends = self._string_ends(state) if walked is self.tokens.quote and not state.escape else None
        refused: list[int] = []
        for word in words:
            bits = int(candidates[word]) & 0xFFFFFFFF
            while bits:
                low = bits & -bits
                token = int(word) * 32 + low.bit_length() - 1
                bits ^= low
                if ends is not None and token in self.tokens.string_end:
                    if not ends(*self.tokens.string_end[token]):
                        refused.append(token)
                elif token < len(token_bytes) and token_bytes[token]:
                    after = self.rules.advance(state, token_bytes[token])
                    if after is None or (self._may_repeat(after) and not self._item_can_end(token)):
                        refused.append(token)
        for token in self._repeating(state):  # tokens after which the item may only end as a duplicate
            if (int(row[token >> 5]) >> (token & 31)) & 1 and token not in refused and \
                    not self._item_can_end(token):
                refused.append(token)
        if not refused:
            return
        before = row.copy()
        flat = row.view(np.uint32)
        for token in refused:
            flat[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)
        if not row.any() and before.any():  # only duplicates are left: yield to the grammar here
            row[:] = before
            if self._yield_at != len(self._states):
                self._yield_at = len(self._states)
                self.yielded += 1

    def _may_repeat(self, state: TrackState) -> bool:
        """Whether the item being written is so far a prefix of an earlier item of its array (or equal to it)."""
        if state.mode not in (STRING, SCALAR) or not self.rules._unique_item(state) or not state.stack[-1].seen:
            return False
        written = b'"' + (state.text or b"") if state.mode == STRING else state.text or b""
        return any(spelling.startswith(written) for key in state.stack[-1].seen for spelling in _spellings(key))

    def _repeating(self, state: TrackState) -> list[int]:
        """The tokens that make the current item's text so far a prefix of an earlier item of its array (``"a`` when
        ``"ab"`` is there, ``7`` when ``7`` is): whether such an item can still end unique depends on the grammar
        (a pattern, a bound, an enum), found by :meth:`_item_can_end`."""
        if state.mode not in (VALUE, ARRAY_FIRST, STRING, SCALAR) or not self.rules._unique_item(state):
            return []
        top = state.stack[-1]
        if not top.seen or (state.mode == STRING and state.escape):
            return []
        written = b"" if state.mode in (VALUE, ARRAY_FIRST) else \
            (b'"' + (state.text or b"")) if state.mode == STRING else (state.text or b"")
        found = []
        for key in top.seen:
            for spelling in _spellings(key):
                if len(spelling) > len(written) and spelling.startswith(written):
                    rest = spelling[len(written):]
                    found.extend(self.tokens.by_bytes[rest[:k]] for k in range(1, len(rest) + 1)
                                 if rest[:k] in self.tokens.by_bytes)
        return found

    def _item_can_end(self, token: int) -> bool:
        """Whether, after ``token``, the grammar lets the current item end as a value its array does not hold yet:
        a depth-first search over one-byte tokens (closers first) on the inner matcher, at most ``LOOKAHEAD_TRIES``
        bytes tried (past that, assumed so); the matcher is left as it was."""
        after = self.rules.advance(self.state, self.tokens.tokenizer.token_bytes[token])
        if after is None or not self.inner.try_accept_token(token):
            return False
        singles = self.tokens.tokenizer.byte_tokens
        tries = 0

        def search(state: TrackState, depth: int) -> bool:
            nonlocal tries
            if state.mode not in (STRING, SCALAR):
                return True  # the item ended, unique (each step checked it)
            for byte in (STRING_SEARCH if state.mode == STRING else SCALAR_SEARCH):
                if tries >= LOOKAHEAD_TRIES or depth >= LOOKAHEAD_DEPTH:
                    return tries >= LOOKAHEAD_TRIES  # out of budget: assumed to end well; too deep: not this way
                following = self.rules.step(state, byte)
                single = singles.get(byte)
                if following is None or single is None:
                    continue
                tries += 1
                if not self.inner.try_accept_token(single):
                    continue
                try:
                    if search(following, depth + 1):
                        return True
                finally:
                    self.inner.rollback(1)
            return False

        try:
            return search(after, 0)
        finally:
            self.inner.rollback(1)

    def _string_ends(self, state: TrackState) -> Callable[[bytes, bytes], bool] | None:
        """Inside a string whose values are unbounded: whether a token that ends it (``head``, the quote, a simple
        ``tail``) keeps the items unique, without walking each token: the tail's effect is the same for every head
        (walked once per tail), and the head completes a duplicate only when an earlier item starts with the string
        so far. None where this does not hold (a finite item set now or next)."""
        rules = self.rules
        item = state.mode == STRING and rules._unique_item(state)
        if item:
            top = state.stack[-1]
            if rules.item_values(top) is not None or rules.positions.child_index(
                    top.position, top.index + 1).finite is not None:
                return None
            prefix = _decode_prefix(state.text or b"")
            close_to = [k for k in top.seen if k[0] == "s" and k[1].startswith(prefix)]
        else:
            close_to = []
        if state.mode == KEY_STRING:
            closed = TrackState(state.stack[:-1] + (state.stack[-1]._replace(key=""),), COLON)
        else:
            closed = rules._complete(TrackState(state.stack, STRING), None, check=False)
        tails: dict[bytes, bool] = {}

        def ends(head: bytes, tail: bytes) -> bool:
            if close_to:
                value = _decode_string((state.text or b"") + head)
                if value is not None and ("s", value) in top.seen:
                    return False
            found = tails.get(tail)
            if found is None:
                found = tails[tail] = closed is not None and rules.advance(closed, tail) is not None
            return found

        return ends

    def try_accept_token(self, token_id: int) -> bool:
        token = int(token_id)
        data = self.tokens.tokenizer.token_bytes[token] if token < len(self.tokens.tokenizer.token_bytes) else b""
        check = self._yield_at != len(self._states)
        after = self.state if token in self._eos or not data else self.rules.advance(self.state, data, check)
        if after is None or (check and self._may_repeat(after) and not self._item_can_end(token)):
            return False  # (the closing's search takes tokens here: it must not walk into an item that cannot end)
        if not self.inner.try_accept_token(token):
            return False
        self._states.append(after)
        return True

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)
        if num_tokens:
            del self._states[-num_tokens:]
            if self._yield_at > len(self._states):
                self._yield_at = -1

    def is_accepting(self) -> bool:
        return self.inner.is_accepting()

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def closing_bytes(self) -> bytes:
        """The inner matcher's, then closers and the digits 1 to 9 before 0: a completion search that needs one
        more unique number tries ``1`` before ``0.000...`` (equal to ``0`` however long)."""
        first = self.inner.closing_bytes()
        return first + bytes(b for b in b'"}],123456789' if b not in first)

    def forced_bytes(self) -> bytes:
        """The inner grammar's forced bytes, as far as they keep the items unique."""
        state = self.state
        out = bytearray()
        for byte in self.inner.forced_bytes():
            next_state = self.rules.step(state, byte)
            if next_state is None:
                break
            out.append(byte)
            state = next_state
        return bytes(out)


class UniqueItemsCache:
    """The token classes of one tokenizer and the rules per schema text (thread-safe; LRU of ``MAX_RULES``), for a
    ``ConstraintFactory``."""

    MAX_RULES = 256

    def __init__(self, tokenizer: TokenizerAdapter) -> None:
        self.tokenizer = tokenizer
        self._tokens: UniqueItemsTokens | None = None
        self._rules: dict[str, UniqueItems | None] = {}
        self._lock = threading.Lock()

    def wrap(self, inner: GrammarMatcher, schema_text: str) -> GrammarMatcher:
        """``inner`` wrapped when the schema requires unique items somewhere, else ``inner`` itself."""
        rules = self.rules(schema_text)
        if rules is None:
            return inner
        if self._tokens is None:
            tokens = UniqueItemsTokens(self.tokenizer)
            with self._lock:
                self._tokens = self._tokens or tokens
        return UniqueItemsMatcher(inner, rules, self._tokens)

    def rules(self, schema_text: str) -> UniqueItems | None:
        """The rules of the JSON schema ``schema_text`` (None when it holds no ``uniqueItems: true``)."""
        with self._lock:
            if schema_text in self._rules:
                return self._rules[schema_text]
        rules = None
        if '"uniqueItems":true' in schema_text:
            rules = UniqueItems(SchemaPositions(json.loads(schema_text)))
        with self._lock:
            if len(self._rules) >= self.MAX_RULES:
                self._rules.pop(next(iter(self._rules)))
            return self._rules.setdefault(schema_text, rules)
