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
