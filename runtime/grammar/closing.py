"""Closing a constrained answer within ``max_tokens``: the shortest completion from a matcher's state, and the mask
source that keeps one within the token budget so that the answer never ends mid-document.

**The completion search** (:func:`shortest_completion`) runs on the sequence's own matcher and rolls back every
token it tries, so the matcher ends exactly where it started. It is a depth-first search over single bytes (each
byte fed as the vocabulary's one-byte token) in a fixed order of preference: what closes first (``"``, ``}``, ``]``,
``)``), then separators, digits, letters, other punctuation, whitespace last; the letter or digit just taken is
tried last at the next position (so ``a+b`` ends ``ab``, not ``aaa...``). Where the grammar forces bytes
(``forced_bytes``: the required keys of a JSON object, the rest of an enum value) they are taken at once. When that
finds nothing within its bounds, a second pass tries byte classes least recently used first (a string pattern that
needs ``/`` or ``@``, late in the order of preference). The first byte string that
reaches an accepting state is tokenised with the real tokenizer (kept when the grammar takes those tokens, else one
token per byte), giving the plan: a token sequence that completes the document. Its length is an upper bound on the
minimum (the search is not exhaustive), which is safe: the document only closes a little earlier. The control
tokens a Lark grammar names (``<[id]>``: a tool call's ``</tool_call>`` that is a control token of the vocabulary;
``CompletionHints.tokens``) have no bytes: they are tried as symbols of their own after every byte, and a plan that
holds one is one token per symbol. The search is
bounded (``MAX_TRIES`` tokens tried, ``MAX_BYTES`` deep); past that it reports no completion. A JSON schema's hints
(``completion_hints``: its required keys, a shortest string per pattern) are tried whole first where they fit, so
that a completion writes required keys only and solves patterns a byte search would loop in. With the sequence's
other mask sources (``rules``: allowed_token_ids, bad_words ...), a plan holds only tokens they allow.

A plan must also be made of tokens the grammar's *mask* allows, which is not the same as tokens its validation takes
(where llguidance forces bytes its mask holds its own spelling of them): near the point where a plan binds, it is
spelled again under the masks (:func:`spelled_under_masks`, ``SPELL_MARGIN``).

**The budget** (:class:`DocumentClosing`, a TokenMaskSource next to the grammar's): at a position with ``budget``
tokens left (``max_tokens`` minus the tokens generated minus the draft path's length, the token at that position
included) and a plan of ``len(plan)`` tokens:

    len(plan) == budget   only the plan's next token is allowed (the last token of the budget ends the document)
    len(plan) <  budget   the grammar's mask; a sampled token after which no plan fits in budget - 1 tokens is
                          replaced by the plan's next token when it is committed (``closable_token``)
    len(plan) >  budget   no completion fits (the budget was already too small): nothing is restricted and the
                          answer is cut (``closed`` stays False; the output says the document is incomplete)

Plans are computed only near the end: when the budget left is within ``WINDOW`` tokens of the last plan's length,
and every ``REFRESH`` tokens otherwise (a token can lengthen the completion a lot: ``{`` of an object with required
keys), so ordinary steps pay nothing but one search per ``REFRESH`` tokens. Committing the plan's next token shifts
the plan (no new search); a rollback forgets every plan.

**Inside a think block** (``think``: the ThinkBudget holding the grammar), the plan is the rest of the end marker
and then the grammar's plan from its start: thinking is ended in time for the document to close.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from ..mask_source import JumpForward, TokenMaskSource
from ..think_mode import ThinkBudget
from .backend import GrammarMatcher
from .completion_hints import CompletionHints
from .source import GrammarSource
from .tokenizer_adapter import TokenizerAdapter

#: Bytes tried at each position of the search, best first: closers, separators, digits, letters, punctuation,
#: whitespace.
PREFERENCE = (b'"}])' + b",:" + b"0123456789" + bytes(range(ord("a"), ord("z") + 1))
              + bytes(range(ord("A"), ord("Z") + 1)) + b"-_.+'/@#$%&*=?!;<>[({|~^`\\" + b" \n\t\r")
#: Bounds of one search: tokens tried (accepted or refused) by the first pass (the second tries half as many) and
#: the longest completion in bytes.
MAX_TRIES = 4_000
MAX_BYTES = 1024
WHITESPACE = frozenset(b" \n\t\r")
#: The second pass looks this many bytes back for the classes and bytes used recently.
NOVELTY = 32
#: Plans are computed when the budget left is at most the last plan's length plus WINDOW, else every REFRESH tokens.
WINDOW = 64
REFRESH = 16
#: A plan is spelled with tokens the grammar's masks allow (``spelled_under_masks``) once the budget left is within
#: this many tokens of its length: before it binds, so that a respelling one token longer still fits.
SPELL_MARGIN = 4
#: At most this many hints are tried at one position.
MACROS = 3
NO_HINTS = CompletionHints()


def shortest_completion(matcher: GrammarMatcher, tokenizer: TokenizerAdapter, max_tries: int = MAX_TRIES,
                        max_bytes: int = MAX_BYTES, hints: CompletionHints = NO_HINTS,
                        permits: Callable[[Sequence[int]], bool] | None = None) -> list[int] | None:
    """Tokens that take ``matcher`` from its state to an accepting one ([] when it accepts already), or None when
    the bounded search finds none; ``hints`` (required keys, strings that match the schema's patterns) are tried
    whole where they fit. With ``permits`` (do the sequence's other rules, ``allowed_token_ids``, ``bad_words``
    ..., allow these tokens in turn from the current state?), the search uses only the one-byte tokens they allow
    first, and the plan is the first tokenisation of the bytes found (the tokenizer's, then one token per byte)
    that they allow throughout; None when neither is. The matcher is left in the state it had."""
    singles = {**tokenizer.byte_tokens, **{CONTROL + k: t for k, t in enumerate(hints.tokens)}}
    if permits is not None:
        singles = {b: t for b, t in singles.items() if permits([t])}
    macros = _Macros(hints, singles)
    found = _complete_bytes(matcher, singles, max_tries, max_bytes, novelty=False, macros=macros)
    if found is None:
        found = _complete_bytes(matcher, singles, max_tries // 2, max_bytes, novelty=True, macros=macros)
    if found is None:
        return None
    if not found:
        return []
    per_byte = [singles[b] for b in found]
    plans = [per_byte]
    merged = _tokenised(found, singles, tokenizer)
    if len(merged) < len(per_byte):
        taken = matcher.try_accept_tokens(merged)
        complete = taken == len(merged) and matcher.is_accepting()
        matcher.rollback(taken)
        if complete:
            plans.insert(0, merged)
    return next((plan for plan in plans if permits is None or permits(plan)), None)


#: Symbols of the search from this value on are control tokens (``CompletionHints.tokens``), tried after every byte.
CONTROL = 256


def _tokenised(found: list[int], singles: dict[int, int], tokenizer: TokenizerAdapter) -> list[int]:
    """The tokenizer's tokens of the bytes found, a control token for each control symbol; one token per symbol
    where a run of bytes does not encode back to itself (not UTF-8, or a tokenisation that changes it)."""
    out: list[int] = []
    run = bytearray()
    for symbol in [*found, None]:
        if symbol is not None and symbol < CONTROL:
            run.append(symbol)
            continue
        if run:
            try:
                ids = tokenizer.encode(bytes(run).decode("utf-8"))
            except UnicodeDecodeError:
                ids = []
            out += ids if ids and tokenizer.decode_bytes(ids) == bytes(run) else [singles[b] for b in run]
            run.clear()
        if symbol is not None:
            out.append(singles[symbol])
    return out


def spelled_under_masks(matcher: GrammarMatcher, tokenizer: TokenizerAdapter, plan: list[int]) -> list[int] | None:
    """``plan`` with every token one the grammar's mask allows at its position (the matcher left as it was).

    A grammar engine's mask may leave out a token its validation takes: where llguidance forces bytes (``":[{``
    after the last key's name), its mask holds one spelling of them (``":``), not the tokenizer's (``":[``), so a
    model cannot sample the latter, and a plan holding it would be a dead end once only the plan's token is allowed.
    From the first token the mask leaves out, the rest of the plan's text is spelled with the longest tokens the
    masks allow; None when no allowed token continues it."""
    text = tokenizer.decode_bytes(plan)
    row = np.empty((tokenizer.vocab_size + 31) // 32, np.int32)
    out: list[int] = []
    position = 0
    try:
        while position < len(text):
            matcher.fill_next_token_bitmask(row)
            index = len(out)
            choice = plan[index] if index < len(plan) and out == plan[:index] else None
            if choice is None or not row[choice >> 5] >> (choice & 31) & 1:
                rest = text[position:position + tokenizer.longest_token]
                spellings = (tokenizer.tokens_by_text.get(rest[:size]) for size in range(len(rest), 0, -1))
                choice = next((t for t in spellings if t is not None and row[t >> 5] >> (t & 31) & 1), None)
            if choice is None or not matcher.try_accept_token(choice):
                return None
            out.append(choice)
            position += len(tokenizer.token_bytes[choice])
        return out if matcher.is_accepting() else None
    finally:
        matcher.rollback(len(out))


#: Byte classes of the second pass: digits, lowercase and uppercase ASCII letters are one class each (-1, -2, -3);
#: any other byte is its own.
BYTE_CLASS = tuple(-1 if 48 <= b <= 57 else -2 if 97 <= b <= 122 else -3 if 65 <= b <= 90 else b for b in range(256))


class _Macros:
    """The hints as one-byte tokens: keys and whole strings by their first byte after the quote, and string tails."""

    def __init__(self, hints: CompletionHints, singles: dict[int, int]) -> None:
        self.by_letter: dict[int, list[bytes]] = {}
        for text in (*hints.keys, *hints.values):
            if len(text) > 2 and all(b in singles for b in text):
                self.by_letter.setdefault(text[1], []).append(text)
        self.tails = [t for t in hints.tails if all(b in singles for b in t)]

    def fitting(self, matcher: GrammarMatcher, singles: dict[int, int]) -> tuple[list[bytes], int]:
        """The hints the grammar takes whole at this position (at most ``MACROS``), and the tokens tried. Where a
        quote fits, the keys and strings that start with it; none where ``""`` fits (any key or string: the
        empty one is shortest). Where it does not (inside a string whose pattern is not met yet), the tails."""
        if not self.by_letter and not self.tails:
            return [], 0
        quote = singles[ord('"')]
        tries, fit = 1, []
        if matcher.try_accept_token(quote):
            tries += 1
            if matcher.try_accept_token(quote):
                matcher.rollback(2)
                return [], tries
            for letter, texts in self.by_letter.items():
                tries += 1
                if not matcher.try_accept_token(singles[letter]):
                    continue
                for text in texts:
                    tries += self._fits(matcher, singles, text[2:], fit, text)
                matcher.rollback(1)
            matcher.rollback(1)
        else:
            for tail in self.tails:
                tries += self._fits(matcher, singles, tail, fit, tail)
                if len(fit) >= MACROS:
                    break
        # keys in the schema's order (nearest the root first), strings shortest first
        return sorted(fit, key=lambda t: (t.endswith(b'"'), len(t) if t.endswith(b'"') else 0))[:MACROS], tries

    @staticmethod
    def _fits(matcher: GrammarMatcher, singles: dict[int, int], rest: bytes, fit: list[bytes], text: bytes) -> int:
        ids = [singles[b] for b in rest]
        taken = matcher.try_accept_tokens(ids)
        matcher.rollback(taken)
        if taken == len(ids):
            fit.append(text)
        return taken + 1


def _byte_class(symbol: int) -> int:
    return BYTE_CLASS[symbol] if symbol < CONTROL else symbol


def _complete_bytes(matcher: GrammarMatcher, singles: dict[int, int], max_tries: int, max_bytes: int,
                    novelty: bool, macros: _Macros | None = None) -> list[int] | None:
    """The depth-first search of the module doc, over bytes; the matcher is restored before returning. With
    ``novelty`` the byte classes are tried least recently used first, and in a class the bytes least recently used
    first (a pattern that needs a byte late in the order of preference), the order of preference breaking ties."""
    first = matcher.closing_bytes()  # bytes a layout closes structures with (the indented layout's newline)
    order = [b for b in first if b in singles] + [b for b in PREFERENCE if b in singles and b not in first]
    order += [s for s in singles if s >= CONTROL]  # control tokens last: where no byte fits
    path: list[int] = []  # bytes, and control tokens as CONTROL + their index
    # One frame per position: (candidates: byte values or whole keys, next index to try, bytes taken there).
    frames: list[tuple[list[int | bytes], int, int]] = []
    tries = 0
    try:
        while True:
            if matcher.is_accepting():
                return path
            forced = matcher.forced_bytes() if len(path) < max_bytes else b""
            if macros is not None and macros.by_letter and b'"' in forced:  # the keys are tried whole at a quote
                forced = forced[:forced.index(b'"')]  # (compact JSON forces '{"a' when every key starts with a)
            forced_ids = [singles.get(b) for b in forced]
            if forced and None not in forced_ids:
                taken = matcher.try_accept_tokens(forced_ids)  # type: ignore[arg-type]
                tries += len(forced_ids)
                if taken:
                    path += forced[:taken]
                    frames.append(([], 0, taken))
                    continue
            candidates: list[int | bytes]
            if novelty:
                # least recently used class first (a round-robin over the classes); whitespace always last
                recent = path[-NOVELTY:]
                last_class = {_byte_class(b): i for i, b in enumerate(recent)}
                last_byte = {b: i for i, b in enumerate(recent)}
                candidates = sorted(order, key=lambda b: (b in WHITESPACE, last_class.get(_byte_class(b), -1),
                                                          last_byte.get(b, -1)))  # type: ignore[arg-type]
            else:
                previous = path[-1] if path and path[-1] < CONTROL and chr(path[-1]).isalnum() else -1
                candidates = [b for b in order if b != previous] + ([previous] if previous in singles else [])
            if macros is not None:
                keys, cost = macros.fitting(matcher, singles)
                tries += cost
                candidates = [*keys, *candidates]
            frames.append((candidates, 0, 0))
            # Try the next candidate of the deepest frame; pop frames whose candidates are spent.
            while True:
                if tries >= max_tries or not frames:
                    return None
                candidates, index, taken = frames[-1]
                if taken:  # undo this position's byte(s) before trying its next candidate
                    matcher.rollback(taken)
                    del path[len(path) - taken :]
                if index >= len(candidates) or len(path) >= max_bytes:
                    frames.pop()
                    continue
                candidate = candidates[index]
                if isinstance(candidate, bytes):  # a whole key (checked to fit): taken at once
                    tries += len(candidate)
                    taken = matcher.try_accept_tokens([singles[b] for b in candidate])
                    path += candidate[:taken]
                    frames[-1] = (candidates, index + 1, taken)
                    if taken == len(candidate):
                        break
                    continue
                tries += 1
                if matcher.try_accept_token(singles[candidate]):
                    path.append(candidate)
                    frames[-1] = (candidates, index + 1, 1)
                    break
                frames[-1] = (candidates, index + 1, 0)
    finally:
        undo = sum(frame[2] for frame in frames)
        if undo:
            matcher.rollback(undo)


class DocumentClosing:
    """The token budget of one sequence's grammar: a TokenMaskSource placed after the grammar's (see the module doc).

    ``max_tokens`` counts every output token, so the source must see every token the sequence commits (it is not
    for a grammar inside a think block, whose tokens the grammar does not see).
    """

    def __init__(self, grammar: GrammarSource, max_tokens: int, hints: CompletionHints = NO_HINTS,
                 rules: Sequence[TokenMaskSource] = (), think: ThinkBudget | None = None) -> None:
        self.grammar = grammar
        #: The thinking budget whose inner source is ``grammar`` (placed before this source): while its block is
        #: open, the plan is the rest of the end marker and then the grammar's plan from its start.
        self.think = think
        self._grammar_seen = grammar.accepted
        self._marker_before = think.end_marker_left() if think is not None else None
        self.max_tokens = max_tokens
        #: What the search may write whole (``completion_hints``) and the sequence's other mask sources
        #: (``allowed_token_ids``, ``bad_words``, a Tree Decode map): a plan uses only tokens they allow.
        self.hints = hints
        self.rules = list(rules)
        self._rule_row = np.empty((grammar.tokenizer.vocab_size + 31) // 32, np.int32) if rules else None
        self.generated = 0
        #: At least one token of the answer was chosen by the closing (a restricted mask or a replaced sample).
        self.closed = False
        #: No completion fits in the tokens left (found by a search from the committed state): the answer is cut.
        self.cut = False
        self._eos = grammar.tokenizer.eos_token_ids
        # Plans by the tokens after the committed ones (() is the current state's plan).
        self._plans: dict[tuple[int, ...], list[int] | None] = {}
        # Plans spelled with tokens the grammar's masks allow (``_allowed``), by their key in ``_plans``.
        self._checked: set[tuple[int, ...]] = set()
        self._estimate: int | None = None  # length of the latest plan, and where it was computed
        self._estimated_at = 0
        self._retry_after = REFRESH  # after a failed search: tokens until the next one (doubled at each failure)
        #: Plans computed, the seconds spent computing them and the longest one (for the benchmark).
        self.searches = 0
        self.search_seconds = 0.0
        self.longest_search = 0.0

    # ---- plans ---------------------------------------------------------------------------------------------------
    def _due(self, position: int, budget: int) -> bool:
        """Whether the position is near enough the end for a plan (else the step pays nothing)."""
        if self.cut:
            return False
        if self._estimate is None:  # never searched, or the last search found nothing
            return not self.searches or position - self._estimated_at >= self._retry_after
        return budget <= self._estimate + WINDOW or position - self._estimated_at >= REFRESH

    def plan(self, draft_path: Sequence[int] = ()) -> list[int] | None:
        """The closing plan after the committed tokens and ``draft_path`` (computed once per state; None: the
        search found none)."""
        key = tuple(int(t) for t in draft_path)
        if key in self._plans:
            return self._plans[key]
        base = self._plans.get(())
        path = list(key)
        if base is not None and base[: len(path)] == path and len(base) >= len(path):
            plan: list[int] | None = base[len(path) :]
        else:
            plan = self._search(path)
        self._plans[key] = plan
        if plan is not None:
            self._estimate, self._estimated_at, self._retry_after = len(plan), self.generated + len(path), REFRESH
            # a completion can shorten by one token per token at most: once none fits, none will (searched no more)
            self.cut = self.cut or (not path and len(plan) > self.max_tokens - self.generated)
        elif not path:  # nothing found from the committed state: try again later, less and less often
            self._estimate, self._estimated_at = None, self.generated
            self._retry_after *= 2
        return plan

    def _search(self, path: list[int]) -> list[int] | None:
        matcher = self.grammar.matcher
        started = time.perf_counter()
        taken = matcher.try_accept_tokens(path) if path else 0
        try:
            if taken < len(path):
                return None
            rows: dict[tuple[int, ...], np.ndarray | None] = {}
            permits = (lambda tokens: self.permitted(path, tokens, rows)) if self.rules else None
            return shortest_completion(matcher, self.grammar.tokenizer, hints=self.hints, permits=permits)
        finally:
            matcher.rollback(taken)
            seconds = time.perf_counter() - started
            self.searches += 1
            self.search_seconds += seconds
            self.longest_search = max(self.longest_search, seconds)

    def permitted(self, path: Sequence[int], tokens: Sequence[int],
                  rows: dict[tuple[int, ...], np.ndarray | None] | None = None) -> bool:
        """Whether the other mask sources (``rules``) allow ``tokens`` in turn after the committed tokens and
        ``path``; ``rows`` keeps their combined rows by prefix (within one search, where the same prefix recurs)."""
        if not self.rules:
            return True
        rows = {} if rows is None else rows
        for index, token in enumerate(tokens):
            prefix = (*path, *tokens[:index])
            if prefix not in rows:
                combined = None
                for rule in self.rules:
                    if rule.fill_bitmask(self._rule_row, prefix):  # type: ignore[arg-type]
                        combined = self._rule_row.copy() if combined is None else combined & self._rule_row
                rows[prefix] = combined
            row = rows[prefix]
            if row is not None and not (int(row[token >> 5]) >> (token & 31)) & 1:
                return False
        return True

    # ---- TokenMaskSource -------------------------------------------------------------------------------------------
    def fill_bitmask(self, row: np.ndarray, draft_path: Sequence[int]) -> bool:
        position = self.generated + len(draft_path)
        budget = self.max_tokens - position
        if budget <= 0:  # past max_tokens (a jump-forward's tokens are checked this way): nothing is allowed
            row.fill(0)
            return True
        if self.think is not None and self.think.phase != "done":
            # thinking, or its end inside the draft path (then not restricted)
            plan = self._thinking_plan(self.think.end_marker_left(draft_path))
        elif not self._due(position, budget):
            return False
        else:
            plan = self.plan(draft_path)
        if plan is not None and len(plan) <= budget <= len(plan) + SPELL_MARGIN and (
                self.think is None or self.think.phase == "done"):
            plan = self._allowed(draft_path, plan)
        if plan is None or len(plan) != budget:
            return False
        row.fill(0)
        token = plan[0]
        row[token >> 5] = np.uint32(1 << (token & 31)).view(np.int32)
        return True

    def _thinking_plan(self, marker: tuple[int, ...] | None) -> list[int] | None:
        """While the think block is open: the rest of its end marker, then the grammar's plan from its start."""
        if not marker:
            return None
        start = self.plan()
        return None if start is None else [*marker, *start]

    def closable_token(self, token_id: int) -> int:
        """The token to commit in place of the sampled ``token_id``: itself, unless no plan would fit in the budget
        after it while one fits now; then the plan's next token (the closing's choice)."""
        budget = self.max_tokens - self.generated
        if token_id in self._eos or budget <= 0:
            return token_id
        if self.think is not None and self.think.phase != "done":
            plan = self._thinking_plan(self.think.end_marker_left())
            if plan is None or len(plan) != budget or plan[0] == token_id:
                return token_id  # a thinking token leaves the plan as long as it was: only its last chance counts
            self.closed = True
            return plan[0]
        if not self._due(self.generated, budget):
            return token_id
        plan = self.plan()
        if plan is None or len(plan) > budget or (plan and plan[0] == token_id):
            return token_id
        after = self.plan([token_id])
        if after is not None and len(after) <= budget - 1:
            return token_id
        if not plan and not self.permitted([], self._eos[:1]):
            return token_id  # accepting, but EOS is not allowed yet (min_tokens): the closing cannot end it here
        self.closed = True
        return self._allowed((), plan)[0] if plan else self._eos[0]

    def _allowed(self, draft_path: Sequence[int], plan: list[int]) -> list[int]:
        """The plan after the committed tokens and ``draft_path``, near the point where it binds: spelled with
        tokens the grammar's masks allow (``spelled_under_masks``: a mask per token, once per plan; the plans it
        shifts to as its tokens are committed stay checked); kept as it was when no such spelling is found."""
        key = tuple(int(t) for t in draft_path)
        if key in self._checked or not plan:
            return plan
        self._checked.add(key)
        matcher = self.grammar.matcher
        taken = matcher.try_accept_tokens(list(key)) if key else 0
        try:
            if taken < len(key):
                return plan
            spelled = spelled_under_masks(matcher, self.grammar.tokenizer, plan)
        finally:
            matcher.rollback(taken)
        if spelled is None or spelled == plan or not self.permitted(key, spelled):
            return plan
        self._plans[key] = spelled
        return spelled

    def accept_token(self, token_id: int) -> None:
        token = int(token_id)
        budget = self.max_tokens - self.generated
        self.generated += 1
        if self.grammar.accepted == self._grammar_seen:  # a thinking token: the grammar's plans stay as they are
            marker = self._marker_before
            self._marker_before = self.think.end_marker_left() if self.think is not None else None
            plan = self._thinking_plan(marker) if marker else None
            self.closed |= plan is not None and len(plan) == budget and plan[0] == token
            return
        self._grammar_seen = self.grammar.accepted
        plan = self._plans.get(())
        if plan and len(plan) == budget and plan[0] == token:
            self.closed = True  # the mask allowed this token alone
        # Plans of the states after this token are kept, one token shorter in their key; the others are dropped.
        checked = () in self._checked
        self._plans = {k[1:]: v for k, v in self._plans.items() if k and k[0] == token}
        self._checked = {k[1:] for k in self._checked if k and k[0] == token}
        if () not in self._plans and plan and plan[0] == token:
            self._plans[()] = plan[1:]
            if checked:
                self._checked.add(())

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.generated -= num_tokens
            self._plans, self._checked, self.cut = {}, set(), False
            self._grammar_seen = self.grammar.accepted
            self._marker_before = self.think.end_marker_left() if self.think is not None else None

    def jump_forward(self, output_token_ids: Sequence[int]) -> JumpForward | None:
        return None
