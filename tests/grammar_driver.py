"""Driving a grammar with random logits, as a model would: the tests' stand-in for a real model.

Each step draws Gumbel noise over the vocabulary (random logits), keeps the tokens the mask allows and takes the
best. After ``patience`` steps, tokens holding a closing character of JSON (quote, bracket, brace, comma) or EOS get
a bonus that grows with the step, so that a random output also finishes (a uniformly random token almost never
closes a string in a 129k vocabulary). Jump-forward, when on, appends forced text through ``GrammarSource``. With
``max_tokens``, a ``DocumentClosing`` keeps the answer closable within that many tokens, as in the engine: its mask
is applied with the grammar's, and each chosen token goes through ``closable_token`` before it is committed.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from logitproc.runtime.grammar import GrammarMatcher, GrammarSource, TokenizerAdapter
from logitproc.runtime.grammar.closing import DocumentClosing
from logitproc.runtime.grammar.completion_hints import CompletionHints

CLOSERS = (b'"', b"}", b"]", b",")


def allowed_ids(row: np.ndarray, vocab_size: int) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size])


def closer_bonus(adapter: TokenizerAdapter) -> np.ndarray:
    bonus = np.array([any(c in b for c in CLOSERS) for b in adapter.token_bytes], np.float32)
    bonus[list(adapter.eos_token_ids)] = 2.0
    return bonus


@dataclass
class Generation:
    token_ids: list[int]
    text: bytes
    finished: bool  # EOS taken
    dead_end: bool
    model_steps: int
    jumped_tokens: int
    complete: bool = False  # the grammar accepts the output (EOS taken, or allowed where it ended)
    closed: bool = False  # the closing chose at least one token (max_tokens given)


def drive(source: GrammarSource, adapter: TokenizerAdapter, rng: np.random.Generator, bonus: np.ndarray,
          max_steps: int = 400, patience: int = 8, jump_forward: bool = False,
          mask_times: list[float] | None = None, max_tokens: int | None = None,
          closing: DocumentClosing | None = None, hints: CompletionHints | None = None) -> Generation:
    """One random generation; with ``mask_times``, the seconds of each mask fill are appended to it; with
    ``max_tokens``, it ends after that many tokens (EOS included), closed in time by ``closing`` (a fresh
    ``DocumentClosing`` of ``source`` with ``hints`` by default)."""
    row = np.empty((adapter.vocab_size + 31) // 32, np.int32)
    extra = np.empty_like(row)
    if closing is None and max_tokens is not None:
        closing = DocumentClosing(source, max_tokens, hints or CompletionHints())
    sources = [source] if closing is None else [source, closing]
    out: list[int] = []
    eos = set(adapter.eos_token_ids)
    steps = jumped = 0

    def result(finished: bool, dead_end: bool = False) -> Generation:
        complete = finished or source.is_accepting
        return Generation(out, adapter.decode_bytes(out), finished, dead_end, steps, jumped, complete,
                          closing is not None and closing.closed)

    def commit(token: int) -> None:
        for s in sources:
            s.accept_token(token)
        out.append(token)

    while steps < max_steps and (max_tokens is None or len(out) < max_tokens):
        if jump_forward:
            found = source.jump_forward(out)
            if found is not None and (max_tokens is None or len(out) - found.rollback + len(found.token_ids)
                                      <= max_tokens):
                for s in sources:
                    s.rollback(found.rollback)
                del out[len(out) - found.rollback:]
                for t in found.token_ids:
                    commit(t)
                jumped += len(found.token_ids)
                if max_tokens is not None and len(out) >= max_tokens:
                    break
        started = time.perf_counter()
        source.fill_bitmask(row, [])
        if closing is not None and closing.fill_bitmask(extra, []):
            np.bitwise_and(row, extra, out=row)
        if mask_times is not None:
            mask_times.append(time.perf_counter() - started)
        allowed = allowed_ids(row, adapter.vocab_size)
        if allowed.size == 0:
            return result(False, True)
        scores = rng.gumbel(size=allowed.size)
        if steps >= patience:
            scores += bonus[allowed] * 0.5 * (steps - patience + 1)
        token = int(allowed[np.argmax(scores)])
        if closing is not None:
            token = closing.closable_token(token)
        steps += 1
        if token in eos:
            source.accept_token(token)
            return result(True)
        commit(token)
    return result(False)


class OutOfBudget(Exception):
    """``accepts_value`` gave up: its search fed more than its budget of texts."""


class _Budget:
    def __init__(self, feeds: int) -> None:
        self.left = feeds


def _feed(matcher: GrammarMatcher, singles: dict[int, int], budget: _Budget, text: bytes) -> int | None:
    """Feed ``text`` byte by byte; the bytes taken, or None (nothing left taken) when the grammar refuses one."""
    budget.left -= 1
    if budget.left < 0:
        raise OutOfBudget
    taken = matcher.try_accept_tokens([singles[b] for b in text])
    if taken == len(text):
        return taken
    matcher.rollback(taken)
    return None


def _spellings(value: object) -> list[bytes]:
    """A scalar as JSON, and an integral number also without ``.0`` (``1.0`` and ``1`` are the same JSON value)."""
    texts = [json.dumps(value, ensure_ascii=False)]
    if isinstance(value, float) and value.is_integer():
        texts.append(str(int(value)))
    return [t.encode() for t in texts]


class _Members:
    """The members of an object still to write, after its first (``first``: none written yet)."""

    def __init__(self, members: list[tuple[str, object]], first: bool) -> None:
        self.members = members
        self.first = first


#: Members tried at each position of an object, best ranked first (``_open_keys``): the member a fixed-order grammar
#: wants ranks first, and a search that tried every one would grow exponentially with the document.
BRANCHES = 2


class _Stop:
    """The end of a partial feed: taken as it is, accepting or not."""


_STOP = _Stop()


def _open_keys(matcher: GrammarMatcher, singles: dict[int, int], budget: _Budget, key: str, item: object,
               others: list[tuple[str, object]], first: bool) -> int | None:
    """How many of ``others``' keys the grammar allows right after the member ``key: item`` (None: it refuses the
    member); the matcher is left as it was. A grammar that fixes the order of properties (llguidance writes them in
    the schema's order) allows the most after the member that comes first, so members are tried in that order."""
    key_text = (b"" if first else b",") + json.dumps(key, ensure_ascii=False).encode() + b":"
    head = _feed(matcher, singles, budget, key_text)
    if head is None:
        return None
    value = _run(matcher, singles, budget, [item, _STOP])
    if value is None:
        matcher.rollback(head)
        return None
    count = 0
    for other, _ in others:
        taken = _feed(matcher, singles, budget, b"," + json.dumps(other, ensure_ascii=False).encode() + b":")
        if taken is not None:
            count += 1
            matcher.rollback(taken)
    matcher.rollback(head + value)
    return count


def _run(matcher: GrammarMatcher, singles: dict[int, int], budget: _Budget, todo: list[object]) -> int | None:
    """Feed the items of ``todo`` (bytes, JSON values, object members) in some spelling the grammar takes, ending in
    an accepting state: object keys in any order, integral numbers with or without ``.0``; the bytes taken (the
    matcher holds them) or None (nothing left taken)."""
    if not todo:
        return 0 if matcher.is_accepting() else None
    head, rest = todo[0], todo[1:]
    options: list[tuple[bytes, list[object]]]
    if isinstance(head, _Stop):
        return 0
    if isinstance(head, bytes):
        options = [(head, rest)]
    elif isinstance(head, _Members):
        if not head.members:
            options = [(b"}", rest)]
        else:
            ranked = []
            for i, (key, item) in enumerate(head.members):
                others = head.members[:i] + head.members[i + 1:]
                count = 0 if len(head.members) == 1 else \
                    _open_keys(matcher, singles, budget, key, item, others, head.first)
                if count is not None:
                    text = (b"" if head.first else b",") + json.dumps(key, ensure_ascii=False).encode() + b":"
                    ranked.append((-count, i, (text, [item, _Members(others, False), *rest])))
            options = [option for *_, option in sorted(ranked, key=lambda r: r[:2])][:BRANCHES]
    elif isinstance(head, dict):
        options = [(b"{", [_Members(list(head.items()), True), *rest])]
    elif isinstance(head, list):
        items: list[object] = []
        for i, item in enumerate(head):
            items += [b","] * bool(i) + [item]
        options = [(b"[", [*items, b"]", *rest])]
    else:
        options = [(text, rest) for text in _spellings(head)]
    for text, after in options:
        taken = _feed(matcher, singles, budget, text)
        if taken is None:
            continue
        more = _run(matcher, singles, budget, after)
        if more is not None:
            return taken + more
        matcher.rollback(taken)
    return None


def accepts_value(matcher: GrammarMatcher, adapter: TokenizerAdapter, value: object,
                  max_feeds: int = 100_000) -> bool:
    """Whether the grammar takes the JSON value ``value`` as a whole document in some spelling (keys in any order,
    integral numbers with or without ``.0``); the matcher is left as it was. ``OutOfBudget`` when the search feeds
    more than ``max_feeds`` texts (a large document that the grammar refuses in every order; the matcher is then
    left where the search was)."""
    taken = _run(matcher, adapter.byte_tokens, _Budget(max_feeds), [value])
    if taken is None:
        return False
    matcher.rollback(taken)
    return True


@dataclass
class Respelled:
    """``respell``'s result: whether the grammar took the whole value, the text it took (the whole value's, or the
    text before the refusal that names the cause: the deepest refusal of a value's text, else of a key) and, on a
    refusal, what it refused there (the bytes tried after that text)."""

    accepted: bool
    text: bytes
    refused: bytes = b""
    numbers: bool = False  # an integral number taken only without its ``.0`` (``1`` for ``1.0``)


class _Speller:
    """The greedy search of ``respell``: the matcher, its texts fed so far (``fed``, from the document's start), the
    refusal that names the cause (``feed``), a budget, and each value's accepted spelling by identity
    (a subschema's order does not depend on where its value stands: found once, fed again as text)."""

    def __init__(self, matcher: GrammarMatcher, singles: dict[int, int], feeds: int) -> None:
        self.matcher, self.singles, self.budget = matcher, singles, _Budget(feeds)
        self.fed = bytearray()
        self.deepest, self.refused = b"", b""
        self.rank = (False, -1)
        self.spelled: dict[int, bytes] = {}

    def feed(self, text: bytes, value: bool = True) -> bool:
        """Feed ``text`` (part of a value, or with ``value`` false a key); a refusal is remembered when it is the
        deepest so far, a value's refusals before any key's (a key refused is how a fixed order shows: the cause
        of a refusal is the value the grammar would not take)."""
        taken = _feed(self.matcher, self.singles, self.budget, text)
        if taken is None:
            rank = (value, len(self.fed))
            if rank >= self.rank:
                self.rank, self.deepest, self.refused = rank, bytes(self.fed), text
            return False
        self.fed += text
        return True

    def back(self, count: int) -> bool:
        """Roll the last ``count`` bytes back; False (for ``value``'s tries)."""
        self.matcher.rollback(count)
        del self.fed[len(self.fed) - count:]
        return False

    def ends(self) -> bool:
        """Whether the scalar just fed is whole where it stands: the document ends, or a separator or closer
        follows (``1.0`` may be a prefix that a ``multipleOf`` grammar takes and cannot end)."""
        if self.matcher.is_accepting():
            return True
        for closer in (b",", b"}", b"]"):
            fed = _feed(self.matcher, self.singles, self.budget, closer)
            if fed is not None:
                self.matcher.rollback(fed)
                return True
        return False

    def value(self, value: object) -> bytes | None:
        """Feed ``value`` (keys in the order the grammar takes them); its text, or None (nothing left fed)."""
        known = self.spelled.get(id(value))
        if known is not None and self.feed(known, value=False):
            return known
        start = len(self.fed)
        if isinstance(value, dict):
            ok = self.feed(b"{") and self.members(list(value.items()))
        elif isinstance(value, list):
            ok = self.feed(b"[") and all((not i or self.feed(b",")) and self.value(item) is not None
                                         for i, item in enumerate(value)) and self.feed(b"]")
        else:
            ok = any(self.feed(text) and (self.ends() or self.back(len(text))) for text in _spellings(value))
        if not ok:
            self.back(len(self.fed) - start)
            return None
        text = bytes(self.fed[start:])
        if isinstance(value, (dict, list)):
            self.spelled[id(value)] = text
        return text

    def members(self, members: list[tuple[str, object]], first: bool = True) -> bool:
        """Feed an object's members, then its ``}``; on a refusal nothing is left fed. At each position, the choices
        of ``choices``: the one of a fixed order at once, each of the ambiguous ones in turn."""
        start = len(self.fed)
        while members:
            tries = self.choices(members, first)
            if len(tries) != 1:
                break
            i, text = tries[0]
            self.feed(text, value=False)
            members, first = members[:i] + members[i + 1:], False
        else:
            if self.feed(b"}"):
                return True
            tries = []
        for i, text in tries:
            self.feed(text, value=False)
            if self.members(members[:i] + members[i + 1:], first=False):
                return True
            self.back(len(text))
        self.back(len(self.fed) - start)
        return False

    def choices(self, members: list[tuple[str, object]], first: bool) -> list[tuple[int, bytes]]:
        """The members to try next (index, text), best first. Of the members the grammar takes here (key and
        value), the one after which it takes all the others of them is the first of a fixed order, the only choice
        (the grammar takes, at a position, the members up to the first required one; after the first of them, the
        others still; after a later one, not the earlier ones). Where none is (branches of an ``anyOf`` that order
        their properties differently), each, most others open first."""
        taken: list[tuple[int, bytes]] = []
        for i, (key, item) in enumerate(members):
            head = (b"" if first else b",") + json.dumps(key, ensure_ascii=False).encode() + b":"
            if not self.feed(head, value=False):
                continue
            text = self.value(item)
            if text is None:
                self.back(len(head))
                continue
            self.back(len(head) + len(text))
            taken.append((i, head + text))
        if len(taken) < 2:
            return taken
        ranked: list[tuple[int, int, bytes]] = []
        for i, text in taken:
            self.feed(text, value=False)
            open_ = 0
            for j, _ in taken:
                probe = b"," + json.dumps(members[j][0], ensure_ascii=False).encode() + b":"
                fed = _feed(self.matcher, self.singles, self.budget, probe) if j != i else None
                if fed is not None:
                    open_ += 1
                    self.matcher.rollback(fed)
            self.back(len(text))
            if open_ == len(taken) - 1:
                return [(i, text)]
            ranked.append((-open_, i, text))
        return [(i, text) for _, i, text in sorted(ranked)]


def _canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def respell(matcher: GrammarMatcher, adapter: TokenizerAdapter, value: object,
            max_feeds: int = 100_000) -> Respelled:
    """``value`` respelled as a grammar that fixes the order of properties writes it: each object's keys in the
    order the grammar takes them, found greedily (each value's spelling found once: at most quadratic in an
    object's members, where ``accepts_value``'s search is exponential in the depth, so it decides large documents),
    integral numbers with or without ``.0``; whether the grammar takes it as a whole document, or where it refused
    what (the cause of a refusal other than the key order: the value it would not take). The matcher is left as it
    was, except after ``OutOfBudget``."""
    speller = _Speller(matcher, adapter.byte_tokens, max_feeds)
    text = speller.value(value)
    if text is not None and matcher.is_accepting():
        matcher.rollback(len(text))
        return Respelled(True, text, numbers=_canonical(json.loads(text)) != _canonical(value))
    if text is not None:
        matcher.rollback(len(text))
    return Respelled(False, speller.deepest, speller.refused)


def maskbench_folder() -> Path | None:
    """The MaskBench development sample (``shared/data/maskbench-dev`` beside the checkout, or
    ``$LOGITPROC_MASKBENCH``), or None when this machine has none."""
    named = os.environ.get("LOGITPROC_MASKBENCH")
    if named:
        return Path(named) if Path(named).is_dir() else None
    for parent in Path(__file__).resolve().parents:
        candidate = parent / "shared" / "data" / "maskbench-dev"
        if candidate.is_dir():
            return candidate
    return None
