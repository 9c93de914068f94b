"""Speculative decoding's plan: per sequence, prompt-lookup drafts and how likely each draft token is to be accepted;
per step, which sequences check how many draft tokens, only where that is expected to give more tokens per second
than decoding.

A sequence's ``Drafter`` keeps an ``NgramIndex`` of its tokens (prompt + output, brought up to date from the state
before each step: new tokens appended, the whole index rebuilt after a rollback) and one acceptance estimate per
*match length* ``l``: how many of the latest tokens equal those before the lookup's source (the matched suffix,
followed further back up to ``_REACH`` tokens). Copies come in runs, and the longer a match has held the likelier
it goes on: a draft token after ``j`` accepted ones continues a match of ``l + j`` tokens, so

    chance(l)  = decayed hits / decayed tries of the lookup's next token at match length l   # l = 1 .. _REACH
    P(j)       = prod(chance(l + i) for i in range(j))     # the first j draft tokens accepted (j = 1 .. k)
    tokens(k)  = 1 + sum(P(j) for j in range(1, k + 1))   # expected tokens a verify of k drafts commits

Every committed token is an observation: before it is appended, the lookup's one-token proposal (and its match
length) is compared with it (a verify's accepted drafts are hits at growing match lengths, the token at a rejection
a miss; tokens decoded without drafts count the same way), so acceptance is measured at every token whether or not
drafts were checked. Each estimate is a decayed count (weight ``_DECAY`` per observation of its length) started from
the rule of succession's guess ``l / (l + 1)`` worth ``_PRIOR_TRIED`` observations: a match that has held for ``l``
tokens goes on with chance ``l / (l + 1)``, so a fresh sequence checks a copy's first draft in full, and a text
without copies (where single-token matches are mostly guesses) brings ``chance(1)`` and ``chance(2)`` down within
a few tokens.

The plan (``SpeculationPlanner.plan``), each step, over the decoding sequences that have a proposal::

    seconds(n) = seconds(1) * (1 + slope * (n - 1))   # a forward of n tokens (decode and verify run the same
                                                      # matmul kernels) and its n rows' share of the rest of
                                                      # the step (processing, sampling, commit, the plan):
                                                      # medians of recent timings (ForwardCosts)
    rate       = decoding / seconds(decoding)         # tokens per second of plain decoding, the baseline
    gain(plan) = (tokens of every decoding sequence) - rate * (seconds of the decode call + of the verify call)

The plan maximises ``gain``, the expected tokens beyond what plain decoding would give in the same time: candidates
are taken in order of ``P(1)``, each with the ``k`` that adds most, while that adds anything. For one sequence this
checks draft ``j`` exactly when ``P(j) > slope``: a draft token is worth checking when its chance of being reached
and accepted exceeds its cost in decode steps (``adaptive=False``: every proposal is checked, at full length).
``k`` is bounded by ``num_speculative_tokens``, the tokens the sequence may still generate and the KV cache room
left.
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
#: Weight of the past in each ``chance(l)`` per observation at that length (about the last 10 count).
_DECAY = 0.9
#: Longest match length told apart (``NgramIndex.propose_matched``'s ``reach``): longer matches count as this long.
_REACH = 8
#: Observations the prior ``l / (l + 1)`` of ``chance(l)`` is worth.
_PRIOR_TRIED = 2.0
#: Before a forward of n tokens was timed: seconds(n) = seconds(1) * (1 + _PRIOR_SLOPE * (n - 1)) (each further
#: token 0.2-0.3x a decode step here with the integer-dot Q4_1 matmuls; before anything is timed seconds(1) is 1: the
#: plan's gain does not depend on the unit), so that drafts are checked from the first step and each length is timed.
_PRIOR_SLOPE = 0.25
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
    """One sequence's prompt-lookup drafts and its acceptance estimates by match length (see the module doc)."""

    def __init__(self, config: SpeculativeConfig, state: RequestState) -> None:
        self.config = config
        self.index = NgramIndex(min_n=config.prompt_lookup_min, max_n=config.prompt_lookup_max)
        self._prompt = len(state.prompt_token_ids)
        self._epoch = -1  # never synced
        # decayed counts of the lookup's next token equalling the one that came, per match length l (index l - 1)
        self._hits = [_PRIOR_TRIED * length / (length + 1) for length in range(1, _REACH + 1)]
        self._tried = [_PRIOR_TRIED] * _REACH
        #: match length behind the latest proposal (0: none)
        self.matched = 0

    def chance(self, matched: int) -> float:
        """The estimated chance that the lookup's next token is accepted after a match of ``matched`` tokens (0
        without a match; lengths past ``_REACH`` count as ``_REACH``)."""
        if matched <= 0:
            return 0.0
        at = min(matched, _REACH) - 1
        return self._hits[at] / self._tried[at]

    def reach_chances(self, k: int) -> list[float]:
        """``P(j)`` for j = 1 .. k: the chance that the latest proposal's first ``j`` tokens are all accepted."""
        out, p = [], 1.0
        for j in range(k):
            p *= self.chance(self.matched + j) if self.matched else 0.0
            out.append(p)
        return out

    def expected_tokens(self, k: int) -> float:
        """Tokens a verify of the latest proposal's first ``k`` tokens commits on average (module doc)."""
        return 1.0 + sum(self.reach_chances(k))

    def _observe(self, matched: int, hit: bool) -> None:
        at = min(matched, _REACH) - 1
        self._hits[at] = self._hits[at] * _DECAY + hit
        self._tried[at] = self._tried[at] * _DECAY + 1.0

    def sync(self, state: RequestState) -> None:
        """Bring the index up to the state's tokens (O(new tokens); the whole index after a rollback), comparing
        each new token with the lookup's one-token proposal before it."""
        if state.rollback_epoch != self._epoch:
            self.index.truncate(0)
            self.index.extend(state.prompt_token_ids)
            self.index.extend(state.output_token_ids)
            self._epoch = state.rollback_epoch
            return
        for token in state.output_token_ids[len(self.index) - self._prompt :]:
            guess, matched = self.index.propose_matched(1, _REACH)
            if guess:
                self._observe(matched, guess[0] == token)
            self.index.append(token)

    def propose(self, k: int) -> list[int]:
        """``k`` draft tokens (``NgramIndex.propose_matched``); ``matched`` and ``reach_chances`` then describe
        them."""
        proposal, self.matched = self.index.propose_matched(k, _REACH)
        return proposal


class ForwardCosts:
    """Seconds of a model forward of n tokens (a decode of n sequences, or a verify of n tokens) with its rows' share
    of the rest of the step (the engine records each call so: processing, sampling, commit and the plan), as
    ``seconds(1) * (1 + slope * (n - 1))``: ``seconds(1)`` the median of the latest forwards of one token, ``slope``
    the median over the recent forwards of more of ``(seconds / seconds(1) - 1) / (n - 1)``, each against the
    ``seconds(1)`` of its own time. Medians, so that a forward slowed by other work on the machine moves neither
    (no token count is left with one bad timing that keeps the plan from trying it again); each timing against the
    decode of its time, as the machine's speed drifts (here by up to 2x within minutes) and a verify timed in a
    fast minute against decodes of a slow one would make drafts look free. Before those are timed: ``seconds(1)``
    from the forwards of more tokens and the prior slope, or 1 (the plan's gain does not depend on the unit), and
    ``slope = _PRIOR_SLOPE``."""

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
        usable.sort(key=lambda c: -c.drafter.chance(c.drafter.matched))
        rate = decoding / self.costs.seconds(decoding)  # plain decoding's tokens per second
        tokens, verified, verify_tokens = float(decoding), 0, 0
        best_gain = tokens - rate * self.costs.seconds(decoding)
        for c in usable:
            best = None
            for k in range(1, min(len(c.proposal), c.limit, room) + 1):
                t = tokens - 1 + c.drafter.expected_tokens(k)
                seconds = self.costs.seconds(decoding - verified - 1) + self.costs.seconds(verify_tokens + k + 1)
                gain = t - rate * seconds
                if gain > best_gain and (best is None or gain > best[0]):
                    best = (gain, k, t)
            if best is None:
                continue
            best_gain, k, tokens = best
            chosen[c.key] = c.proposal[:k]
            verified, verify_tokens, room = verified + 1, verify_tokens + k + 1, room - k
        return chosen
