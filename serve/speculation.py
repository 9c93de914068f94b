"""Speculative decoding's plan: per sequence, prompt-lookup drafts and how often they are accepted; per step, which
sequences check how many draft tokens, only where that is expected to give more tokens per second than decoding.

A sequence's ``Drafter`` keeps an ``NgramIndex`` of its tokens (prompt + output, brought up to date from the state
before each step: new tokens appended, the whole index rebuilt after a rollback) and two acceptance estimates,
because copies come in runs (a draft is either a copy in progress, accepted to its end, or a guess that fails at
its first token):

* ``alpha_for(n)``, the chance that the first token of a fresh draft is accepted, for each length ``n`` of the
  matched suffix (a draft found by a 4-gram is usually a copy starting; one found by a single token often a guess);
* ``follow``, the chance that a draft token is accepted when the token before it was (the copy goes on).

While a copy is going on (``running``: the latest ``_RUN`` tokens or more equalled draft tokens, as after a draft of
that many accepted in full) the next draft's first token is itself a continuation, so it counts with ``follow``:
after a full acceptance the next draft is checked at full length at once, whatever its suffix length. A verify of
``k`` drafts of which ``m`` were accepted observes its first ``min(m + 1, k)`` positions (the first with
``alpha_for(n)``, or ``follow`` while running; the others with ``follow``), hits for the ``m`` accepted; a proposal
that was not checked (the plan found it would not pay) is compared with the tokens that come next instead, so both
keep being measured for free. Each estimate is a decayed count (weight ``_DECAY`` per observation) started from a
prior worth two observations.

The plan (``SpeculationPlanner.plan``), each step, over the decoding sequences that have a proposal::

    first      = follow if running else alpha_for(n)               # chance the draft's first token is accepted
    tokens(k)  = 1 + first * sum(follow ** i for i in range(k))     # expected tokens committed by a verify of k
    seconds(n) = seconds(1) * (1 + slope * (n - 1))   # a forward of n tokens (decode and verify run the same
                                                      # matmul kernels): medians of recent timings (ForwardCosts)
    rate       = (tokens of every decoding sequence) / (seconds of the decode call + seconds of the verify call)

Candidates are taken in order of ``first``, each with the ``k`` that does best, while the step's expected rate
improves on decoding them all (``adaptive=False``: every proposal is checked, at full length). ``k`` is bounded by
``num_speculative_tokens``, the tokens the sequence may still generate and the KV cache room left.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from logitproc.runtime import RequestState

from .ngram_index import NgramIndex

METHODS = ("ngram",)
#: Largest ``num_speculative_tokens`` and ``prompt_lookup_max``: a verify forward holds 1 + k tokens of a sequence.
MAX_SPECULATIVE_TOKENS = 32
MAX_LOOKUP = 32
#: Weight of the past in ``alpha`` per position observed (about the last 10 positions count).
_DECAY = 0.9
#: ``alpha_for(n)`` (a fresh draft's first token) before anything was observed, by the matched suffix's length (1, 2,
#: 3 or more tokens), as two observations: a match of 3 tokens or more is usually a copy starting, a single token's
#: often a guess.
_PRIOR_ALPHA = (0.3, 0.5, 0.8)
#: ``follow`` before anything was observed: a draft token after an accepted one (copies come in runs).
_PRIOR_FOLLOW = 0.8
_PRIOR_TRIED = 2.0
#: Before a forward of n tokens was timed: seconds(n) = seconds(1) * (1 + _PRIOR_SLOPE * (n - 1)) (each further
#: token 0.2-0.3x a decode step here with the packed Q4_1 matmuls; before anything is timed seconds(1) is 1: the plan
#: only compares rates), so that drafts are checked from the first step and each length is timed once tried.
_PRIOR_SLOPE = 0.25
#: Draft tokens accepted in a row that make a copy going on (``running``): one or two are often a common word or
#: phrase met again in open text.
_RUN = 3
#: Recent forward timings kept, of one token and of more, and the latest of one token that make ``seconds(1)``
#: (``ForwardCosts``).
_TIMINGS = 16
_LATEST = 5


def _int_in(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"speculative: {name} must be an int in [{low}, {high}], got {value!r}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's names: ``method`` (only "ngram", prompt lookup), ``num_speculative_tokens`` (K, the longest draft),
    ``prompt_lookup_min``/``prompt_lookup_max`` (n-gram lengths searched, longest first); ``adaptive`` shortens or
    skips drafts that do not pay (False: every proposal is checked at full length)."""

    method: str = "ngram"
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative: method must be one of {list(METHODS)}, got {self.method!r}")
        _int_in("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _int_in("prompt_lookup_min", self.prompt_lookup_min, 1, MAX_LOOKUP)
        _int_in("prompt_lookup_max", self.prompt_lookup_max, 1, MAX_LOOKUP)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative: adaptive must be a boolean, got {self.adaptive!r}")

    @classmethod
    def of(cls, value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
        """A config from a config, a dict of its fields (vLLM's ``speculative_config``), the CLI's ``ngram[:K]``,
        or None (off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        if not isinstance(value, Mapping):
            raise TypeError(f"speculative must be a dict, a SpeculativeConfig, 'ngram[:K]' or None, got "
                            f"{type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative: unknown keys {unknown}; the keys are {sorted(known)}")
        return cls(**value)

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """``ngram`` or ``ngram:K`` (the CLI's ``--speculative``)."""
        method, _, k = text.partition(":")
        if not k:
            return cls(method=method)
        try:
            tokens = int(k)
        except ValueError:
            raise ValueError(f"speculative: {text!r}: K in 'ngram:K' must be an int, got {k!r}") from None
        return cls(method=method, num_speculative_tokens=tokens)


class Drafter:
    """One sequence's prompt-lookup drafts and its acceptance estimates (see the module doc)."""

    def __init__(self, config: SpeculativeConfig, state: RequestState) -> None:
        self.config = config
        self.index = NgramIndex(min_n=config.prompt_lookup_min, max_n=config.prompt_lookup_max)
        self._prompt = len(state.prompt_token_ids)
        self._epoch = -1  # never synced
        # decayed counts of accepted and tried first draft tokens, per matched suffix length n (index n - 1) ...
        self._accepted = [_PRIOR_TRIED * _PRIOR_ALPHA[min(n, len(_PRIOR_ALPHA)) - 1]
                          for n in range(1, config.prompt_lookup_max + 1)]
        self._tried = [_PRIOR_TRIED] * config.prompt_lookup_max
        # ... and of draft tokens that follow an accepted one (a copy going on)
        self._follow = [_PRIOR_TRIED * _PRIOR_FOLLOW, _PRIOR_TRIED]
        self._shadow: list[int] = []  # a proposal not checked, compared with the tokens that come
        self._shadow_n = 0  # its suffix length while its first token is compared, then -1 (tokens that follow)
        self._shadow_running = False
        self.matched = 0  # suffix length behind the latest proposal
        #: draft tokens accepted (or, unchecked, equalled) in a row up to the latest token
        self.run = 0

    @property
    def running(self) -> bool:
        """A copy is going on: the latest ``_RUN`` tokens or more equalled draft tokens (a draft accepted in full
        ends that way)."""
        return self.run >= _RUN

    def alpha_for(self, matched: int) -> float:
        """The estimated chance that the first token of a fresh draft found by a suffix of ``matched`` tokens is
        accepted (0 without a match)."""
        return self._accepted[matched - 1] / self._tried[matched - 1] if matched else 0.0

    @property
    def follow(self) -> float:
        """The estimated chance that a draft token is accepted after the one before it was (a copy goes on)."""
        return self._follow[0] / self._follow[1]

    @property
    def alpha(self) -> float:
        """The estimated chance that the latest proposal's first token is accepted: ``follow`` while a copy is
        going on (``running``), else that of a fresh match of its suffix length."""
        if not self.matched:
            return 0.0
        return self.follow if self.running else self.alpha_for(self.matched)

    def expected_tokens(self, k: int) -> float:
        """Tokens a verify of the latest proposal's first ``k`` tokens commits on average (module doc)."""
        return expected_tokens(self.alpha, k, self.follow)

    def _observe(self, first: bool, matched: int, running: bool, hit: bool) -> None:
        """One draft token compared: the first of its draft (found by a suffix of ``matched``; ``running``: while a
        copy was going on) or one after an accepted token."""
        if first and not running:
            if matched:
                self._accepted[matched - 1] = self._accepted[matched - 1] * _DECAY + hit
                self._tried[matched - 1] = self._tried[matched - 1] * _DECAY + 1.0
        else:
            self._follow = [self._follow[0] * _DECAY + hit, self._follow[1] * _DECAY + 1.0]
        self.run = self.run + 1 if hit else 0

    def sync(self, state: RequestState) -> None:
        """Bring the index up to the state's tokens (O(new tokens); the whole index after a rollback), comparing
        the tokens that came with an unchecked proposal."""
        if state.rollback_epoch != self._epoch:
            self.index.truncate(0)
            self.index.extend(state.prompt_token_ids)
            self.index.extend(state.output_token_ids)
            self._epoch, self._shadow, self.run = state.rollback_epoch, [], 0
            return
        for token in state.output_token_ids[len(self.index) - self._prompt :]:
            if self._shadow:
                hit = self._shadow[0] == token
                self._observe(self._shadow_n > 0, abs(self._shadow_n), self._shadow_running, hit)
                self._shadow_n = -1  # the next ones follow a compared token
                self._shadow = self._shadow[1:] if hit else []
            self.index.append(token)

    def propose(self, k: int) -> list[int]:
        """``k`` draft tokens (``NgramIndex.propose``); ``matched`` and ``alpha`` then describe them."""
        proposal, self.matched = self.index.propose_matched(k)
        if not proposal:
            self.run = 0  # nothing continues: a copy going on would have been found
        return proposal

    def shadow(self, proposal: list[int]) -> None:
        """``proposal`` (the latest) was not checked: compare it with the tokens that come (unless one is being
        compared)."""
        if not self._shadow:
            self._shadow, self._shadow_n, self._shadow_running = list(proposal), self.matched, self.running

    def record(self, drafted: int, accepted: int) -> None:
        """A verify of ``drafted`` tokens (the latest proposal's) accepted the first ``accepted``."""
        running = self.running
        for i in range(min(accepted + 1, drafted)):
            self._observe(i == 0, self.matched, running, i < accepted)
        self._shadow = []


class ForwardCosts:
    """Seconds of a model forward of n tokens (a decode of n sequences, or a verify of n tokens), as
    ``seconds(1) * (1 + slope * (n - 1))``: ``seconds(1)`` the median of the latest forwards of one token, ``slope``
    the median over the recent forwards of more of ``(seconds / seconds(1) - 1) / (n - 1)``, each against the
    ``seconds(1)`` of its own time. Medians, so that a forward slowed by other work on the machine moves neither
    (no token count is left with one bad timing that keeps the plan from trying it again); each timing against the
    decode of its time, as the machine's speed drifts (here by up to 2x within minutes) and a verify timed in a
    fast minute against decodes of a slow one would make drafts look free. Before those are timed: ``seconds(1)``
    from the forwards of more tokens and the prior slope, or 1 (the plan only compares rates), and ``slope =
    _PRIOR_SLOPE``."""

    def __init__(self) -> None:
        self._one: deque[float] = deque(maxlen=_TIMINGS)
        #: (tokens, seconds, seconds(1) then or 0 when none was timed yet)
        self._more: deque[tuple[int, float, float]] = deque(maxlen=_TIMINGS)

    def record(self, tokens: int, seconds: float) -> None:
        if tokens == 1 and seconds > 0:
            self._one.append(seconds)
        elif tokens > 1 and seconds > 0:
            self._more.append((tokens, seconds, self._base() or 0.0))

    def _base(self) -> float | None:
        return statistics.median(list(self._one)[-_LATEST:]) if self._one else None

    def _line(self) -> tuple[float, float]:
        """``(seconds(1), slope)``."""
        base = self._base()
        if base is None:
            if not self._more:
                return 1.0, _PRIOR_SLOPE
            return statistics.median(t / (1 + _PRIOR_SLOPE * (n - 1)) for n, t, _ in self._more), _PRIOR_SLOPE
        if not self._more:
            return base, _PRIOR_SLOPE
        return base, max(0.0, statistics.median((t / (then or base) - 1) / (n - 1) for n, t, then in self._more))

    def seconds(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        base, slope = self._line()
        return base * (1 + slope * (tokens - 1))


def expected_tokens(first: float, k: int, follow: float | None = None) -> float:
    """Tokens a verify of ``k`` drafts commits on average: the first draft accepted with chance ``first``, each
    later one, once the one before it was, with chance ``follow`` (``first`` when not given: independent drafts)."""
    follow = first if follow is None else follow
    return 1.0 + first * sum(follow**i for i in range(k))


@dataclass
class Candidate:
    """A decoding sequence's proposal for this step and the most drafts it may check (``limit``)."""

    key: Any
    drafter: Drafter
    proposal: list[int]
    limit: int


class SpeculationPlanner:
    """Chooses, each step, the drafts to check (see the module doc) and learns the forward costs."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.costs = ForwardCosts()

    def plan(self, candidates: list[Candidate], decoding: int, room: int) -> dict[Any, list[int]]:
        """Drafts to check, by candidate key. ``decoding``: the sequences that decode this step (the candidates
        among them); ``room``: KV cache tokens free for drafts."""
        chosen = self._choose(candidates, decoding, room)
        for c in candidates:
            if c.key not in chosen and c.proposal:
                c.drafter.shadow(c.proposal)
        return chosen

    def _choose(self, candidates: list[Candidate], decoding: int, room: int) -> dict[Any, list[int]]:
        chosen: dict[Any, list[int]] = {}
        usable = [c for c in candidates if c.proposal and c.limit > 0]
        if not self.config.adaptive:
            for c in usable:
                k = min(len(c.proposal), c.limit, room)
                if k > 0:
                    chosen[c.key] = c.proposal[:k]
                    room -= k
            return chosen
        if not usable:
            return chosen
        usable.sort(key=lambda c: -c.drafter.alpha)
        best_rate = decoding / self.costs.seconds(decoding)
        tokens, verified, verify_tokens = float(decoding), 0, 0
        for c in usable:
            best = None
            for k in range(1, min(len(c.proposal), c.limit, room) + 1):
                t = tokens - 1 + c.drafter.expected_tokens(k)
                seconds = self.costs.seconds(decoding - verified - 1) + self.costs.seconds(verify_tokens + k + 1)
                rate = t / seconds
                if rate > best_rate and (best is None or rate > best[0]):
                    best = (rate, k, t)
            if best is None:
                continue
            best_rate, k, tokens = best
            chosen[c.key] = c.proposal[:k]
            verified, verify_tokens, room = verified + 1, verify_tokens + k + 1, room - k
        return chosen
