"""Think mode: a thinking budget, and an inner constraint (e.g. a grammar) that applies only after thinking ends.

:class:`ThinkBudget` follows one sequence through three phases:

``before``   waiting for the begin marker (e.g. the ids of ``<think>``); no constraint. Skipped with
             ``starts_in_thinking=True`` (models whose chat template opens the think block in the prompt).
``thinking`` every accepted token counts as a thinking token; the end marker (e.g. the ids of ``</think>``) may be
             emitted freely. Once ``max_thinking_tokens`` tokens have been counted, the end marker is forced token
             by token: only its next token is allowed. If the thinking text already ends with the first j tokens of
             the marker when the budget runs out, forcing continues from token j (no half-marker is repeated).
``done``     thinking has ended (the end marker is complete). The optional ``inner`` source constrains every later
             position and is advanced by every later token; before this phase it is neither consulted nor advanced.

Budget guarantee: at most ``max_thinking_tokens`` tokens lie between the end of the begin marker and the start of
the end marker (the marker's own forced tokens are not counted). ``max_thinking_tokens=None`` sets no budget (the
source then only gates ``inner``). Markers are matched as token sequences with a KMP automaton, so overlapping
partial matches (e.g. ``[5, 5, 6]`` after ``5 5 5 6``) are found. Only the first think block counts: a begin marker
after thinking has ended is ordinary output for ``inner``.

Draft paths are simulated on a copy of the small phase state (no state changes); the tokens of a draft path after
the point where thinking ends there are passed to ``inner.fill_bitmask`` as its draft path.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .mask_source import JumpForward, TokenMaskSource

BEFORE, THINKING, DONE = "before", "thinking", "done"


def _marker(name: str, ids: Sequence[int]) -> tuple[int, ...]:
    out = tuple(ids)
    if not out:
        raise ValueError(f"{name} must hold at least one token id")
    for t in out:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0:
            raise ValueError(f"{name}: token ids must be ints >= 0, got {t!r}")
    return tuple(int(t) for t in out)


class _Matcher:
    """KMP automaton over a token sequence: ``step(matched, t)`` is the longest marker prefix ending at t."""

    __slots__ = ("ids", "_fail")

    def __init__(self, ids: tuple[int, ...]) -> None:
        self.ids = ids
        fail = [0] * len(ids)
        k = 0
        for i in range(1, len(ids)):
            while k and ids[i] != ids[k]:
                k = fail[k - 1]
            if ids[i] == ids[k]:
                k += 1
            fail[i] = k
        self._fail = fail

    def step(self, matched: int, token: int) -> int:
        ids = self.ids
        if matched == len(ids):
            matched = self._fail[matched - 1]
        while matched and ids[matched] != token:
            matched = self._fail[matched - 1]
        return matched + 1 if ids[matched] == token else 0


class _State(NamedTuple):
    phase: str
    matched: int  # before: begin-marker prefix matched; thinking: end-marker prefix matched
    count: int  # thinking tokens accepted so far


class ThinkBudget:
    """A TokenMaskSource enforcing a thinking budget, with an optional inner source applied after thinking."""

    def __init__(self, begin_ids: Sequence[int], end_ids: Sequence[int], max_thinking_tokens: int | None,
                 inner: TokenMaskSource | None = None, starts_in_thinking: bool = False) -> None:
        self.end_ids = _marker("end_ids", end_ids)
        self.begin_ids = _marker("begin_ids", begin_ids) if begin_ids or not starts_in_thinking else ()
        if max_thinking_tokens is not None and (isinstance(max_thinking_tokens, bool)
                                                or not isinstance(max_thinking_tokens, int)
                                                or max_thinking_tokens < 0):
            raise ValueError(f"max_thinking_tokens must be None or an int >= 0, got {max_thinking_tokens!r}")
        self.max_thinking_tokens = max_thinking_tokens
        self.inner = inner
        self._begin = _Matcher(self.begin_ids) if self.begin_ids else None
        self._end = _Matcher(self.end_ids)
        self._state = _State(THINKING if starts_in_thinking else BEFORE, 0, 0)
        self._history: list[tuple[_State, bool]] = []  # per accepted token: state before it, whether inner took it
        self._inner_taken = 0  # tokens the inner source has accepted

    # ---- the automaton ------------------------------------------------------------------------------------------
    def _step(self, state: _State, token: int) -> _State:
        phase, matched, count = state
        if phase == BEFORE:
            assert self._begin is not None
            matched = self._begin.step(matched, token)
            if matched == len(self.begin_ids):
                return _State(THINKING, 0, 0)
            return _State(BEFORE, matched, 0)
        if phase == THINKING:
            matched = self._end.step(matched, token)
            if matched == len(self.end_ids):
                return _State(DONE, 0, count + 1)
            return _State(THINKING, matched, count + 1)
        return state

    def _forced_token(self, state: _State) -> int | None:
        budget = self.max_thinking_tokens
        if state.phase == THINKING and budget is not None and state.count >= budget:
            return self.end_ids[state.matched]
        return None

    # ---- TokenMaskSource ----------------------------------------------------------------------------------------
    def fill_bitmask(self, row: np.ndarray, draft_path: Sequence[int]) -> bool:
        state = self._state
        rest: Sequence[int] = draft_path
        if state.phase != DONE:
            for i, token in enumerate(draft_path):
                state = self._step(state, int(token))
                if state.phase == DONE:
                    rest = draft_path[i + 1:]
                    break
        if state.phase == DONE:
            return self.inner.fill_bitmask(row, rest) if self.inner is not None else False
        forced = self._forced_token(state)
        if forced is None:
            return False
        if forced >= row.size * 32:
            raise ValueError(f"think budget: end marker token {forced} is outside the bitmask row "
                             f"({row.size * 32} tokens)")
        row.fill(0)
        row.view(np.uint32)[forced >> 5] = np.uint32(1) << np.uint32(forced & 31)
        return True

    def accept_token(self, token_id: int) -> None:
        if self._state.phase == DONE:
            if self.inner is not None:
                self.inner.accept_token(token_id)
                self._inner_taken += 1
            self._history.append((self._state, self.inner is not None))
            return
        self._history.append((self._state, False))
        self._state = self._step(self._state, int(token_id))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (the inner source rolls back the ones it took)."""
        if not 0 <= num_tokens <= len(self._history):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {len(self._history)} were accepted")
        if num_tokens == 0:
            return
        undone = self._history[len(self._history) - num_tokens:]
        inner_count = sum(took for _, took in undone)
        if inner_count:
            self.inner.rollback(inner_count)  # type: ignore[union-attr]
            self._inner_taken -= inner_count
        self._state = undone[0][0]
        del self._history[len(self._history) - num_tokens:]

    def jump_forward(self, output_token_ids: Sequence[int]) -> JumpForward | None:
        """The inner source's jump-forward once thinking has ended (its own output only); None before."""
        if self._state.phase != DONE or self.inner is None:
            return None
        taken = self._inner_taken
        return self.inner.jump_forward(list(output_token_ids)[len(output_token_ids) - taken:])

    # ---- inspection ---------------------------------------------------------------------------------------------
    @property
    def phase(self) -> str:
        """'before', 'thinking' or 'done'."""
        return self._state.phase

    @property
    def thinking_tokens(self) -> int:
        """Tokens accepted inside the think block so far (the end marker's tokens included once it is emitted)."""
        return self._state.count

    def end_marker_left(self, draft_path: Sequence[int] = ()) -> tuple[int, ...] | None:
        """After ``draft_path``: the end-marker tokens still to come while the think block is open (the ones
        already written excluded), () while waiting for the begin marker, None once thinking has ended."""
        state = self._state
        for token in draft_path:
            state = self._step(state, int(token))
        if state.phase == DONE:
            return None
        return self.end_ids[state.matched:] if state.phase == THINKING else ()

    @property
    def forcing(self) -> bool:
        """True while the budget is spent and the end marker is being forced."""
        return self._forced_token(self._state) is not None

    def __deepcopy__(self, memo: dict[int, Any]) -> ThinkBudget:
        other = ThinkBudget.__new__(ThinkBudget)
        other.__dict__.update(self.__dict__)
        other.inner = copy.deepcopy(self.inner, memo)
        other._history = list(self._history)
        return other

    def __repr__(self) -> str:
        return (f"ThinkBudget(phase={self.phase!r}, thinking_tokens={self.thinking_tokens}, "
                f"max_thinking_tokens={self.max_thinking_tokens}, forcing={self.forcing})")
