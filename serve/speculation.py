"""Speculative decoding's plan: per sequence, prompt-lookup drafts and how often they are accepted; per step, which
sequences check how many draft tokens, only where that is expected to give more tokens per second than decoding.

A sequence's ``Drafter`` keeps an ``NgramIndex`` of its tokens (prompt + output, brought up to date from the state
before each step: new tokens appended, the whole index rebuilt after a rollback) and an estimate of ``alpha``, the
chance that a draft token is accepted, for each length of the matched suffix (a draft found by a 4-gram is usually
a copy in progress; one found by a single token is often a guess). Each verified draft of ``k`` tokens of which
``m`` were accepted counts ``m`` accepted positions out of ``min(m + 1, k)`` tried; a draft that was proposed but not
checked (the plan found it would not pay) is compared with the tokens that come next instead, so ``alpha`` keeps
being measured for free.

The plan (``SpeculationPlanner.plan``), each step, over the decoding sequences that have a proposal::

    tokens(k)  = sum(alpha ** i for i in range(k + 1))   # expected tokens committed by a verify of k drafts
    seconds(n) = the measured time of a forward of n tokens (decode and verify run the same matmul kernels)
    rate       = (tokens of every decoding sequence) / (seconds of the decode call + seconds of the verify call)

Candidates are taken in order of ``alpha``, each with the ``k`` that does best, while the step's expected rate
improves on decoding them all (``adaptive=False``: every proposal is checked, at full length). ``k`` is bounded by
``num_speculative_tokens``, the tokens the sequence may still generate and the KV cache room left.
"""

from __future__ import annotations

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
#: ``alpha`` before anything was observed, by the matched suffix's length (1, 2, 3 or more tokens), as two
#: observations: a match of 3 tokens or more is usually a copy in progress, a single token's often a guess.
_PRIOR_ALPHA = (0.3, 0.5, 0.8)
_PRIOR_TRIED = 2.0
#: Before a forward of n tokens was timed: seconds(n) = seconds(1) * (1 + _PRIOR_SLOPE * (n - 1)), on the cheap side
#: (each further token about 0.4x a decode step here), so that a longer draft is tried once and then timed.
_PRIOR_SLOPE = 0.25


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
    """One sequence's prompt-lookup drafts and its acceptance estimate (see the module doc)."""

    def __init__(self, config: SpeculativeConfig, state: RequestState) -> None:
        self.config = config
        self.index = NgramIndex(min_n=config.prompt_lookup_min, max_n=config.prompt_lookup_max)
        self._prompt = len(state.prompt_token_ids)
        self._epoch = -1  # never synced
        # per matched suffix length n (index n - 1): decayed counts of accepted and tried draft positions
        self._accepted = [_PRIOR_TRIED * _PRIOR_ALPHA[min(n, len(_PRIOR_ALPHA)) - 1]
                          for n in range(1, config.prompt_lookup_max + 1)]
        self._tried = [_PRIOR_TRIED] * config.prompt_lookup_max
        self._shadow: list[int] = []  # a proposal not checked, compared with the tokens that come next
        self._shadow_n = 0
        self.matched = 0  # suffix length behind the latest proposal

    def alpha_for(self, matched: int) -> float:
        """The estimated chance that a draft token found by a suffix of ``matched`` tokens is accepted."""
        return self._accepted[matched - 1] / self._tried[matched - 1] if matched else 0.0

    @property
    def alpha(self) -> float:
        """The estimate for the latest proposal."""
        return self.alpha_for(self.matched)

    def _observe(self, matched: int, hit: bool) -> None:
        if matched:
            self._accepted[matched - 1] = self._accepted[matched - 1] * _DECAY + hit
            self._tried[matched - 1] = self._tried[matched - 1] * _DECAY + 1.0

    def sync(self, state: RequestState) -> None:
        """Bring the index up to the state's tokens (O(new tokens); the whole index after a rollback), comparing
        the tokens that came with an unchecked proposal."""
        if state.rollback_epoch != self._epoch:
            self.index.truncate(0)
            self.index.extend(state.prompt_token_ids)
            self.index.extend(state.output_token_ids)
            self._epoch, self._shadow = state.rollback_epoch, []
            return
        for token in state.output_token_ids[len(self.index) - self._prompt :]:
            if self._shadow:
                hit = self._shadow[0] == token
                self._observe(self._shadow_n, hit)
                self._shadow = self._shadow[1:] if hit else []
            self.index.append(token)

    def propose(self, k: int) -> list[int]:
        """``k`` draft tokens (``NgramIndex.propose``); ``matched`` and ``alpha`` then describe them."""
        proposal, self.matched = self.index.propose_matched(k)
        return proposal

    def shadow(self, proposal: list[int]) -> None:
        """``proposal`` (the latest) was not checked: compare it with the tokens that come (unless one is being
        compared)."""
        if not self._shadow:
            self._shadow, self._shadow_n = list(proposal), self.matched

    def record(self, drafted: int, accepted: int) -> None:
        """A verify of ``drafted`` tokens (the latest proposal's) accepted the first ``accepted``."""
        for _ in range(accepted):
            self._observe(self.matched, True)
        if accepted < drafted:
            self._observe(self.matched, False)
        self._shadow = []


class ForwardCosts:
    """Seconds of a model forward by its token count (decode of n sequences, or verify of n tokens), averaged."""

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}

    def record(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            old = self._seconds.get(tokens)
            self._seconds[tokens] = seconds if old is None else 0.7 * old + 0.3 * seconds

    @property
    def known(self) -> bool:
        return 1 in self._seconds

    def seconds(self, tokens: int) -> float:
        """Measured, else interpolated between the nearest measured counts, else extrapolated from seconds(1)."""
        if tokens <= 0:
            return 0.0
        table = self._seconds
        if tokens in table:
            return table[tokens]
        below = max((n for n in table if n < tokens), default=None)
        above = min((n for n in table if n > tokens), default=None)
        if below is not None and above is not None:
            w = (tokens - below) / (above - below)
            return (1 - w) * table[below] + w * table[above]
        base = table.get(1, 1.0)
        if below is not None:  # beyond the largest measured count: its time plus the prior slope
            return table[below] + base * _PRIOR_SLOPE * (tokens - below)
        return base * (1 + _PRIOR_SLOPE * (tokens - 1))


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a verify of ``k`` drafts commits on average, each draft accepted with chance ``alpha``."""
    return sum(alpha**i for i in range(k + 1))


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
        if not usable or not self.costs.known:  # nothing to check, or nothing timed yet: decode, and measure
            return chosen
        usable.sort(key=lambda c: -c.drafter.alpha)
        best_rate = decoding / self.costs.seconds(decoding)
        tokens, verified, verify_tokens = float(decoding), 0, 0
        for c in usable:
            best = None
            for k in range(1, min(len(c.proposal), c.limit, room) + 1):
                t = tokens - 1 + expected_tokens(c.drafter.alpha, k)
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
