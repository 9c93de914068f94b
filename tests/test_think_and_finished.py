"""Think budget and finished-sequence masks: random runs through the real processor and sampler, drafts, errors."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import pytest
from logitproc import GenerationConfig, RequestState
from logitproc.runtime import DraftTree
from logitproc.runtime.finished_sequences import FinishedSequenceMask
from logitproc.runtime.think_mode import DONE, THINKING, ThinkBudget
from logitproc.tir_kernels import reference as ref

V = 40


class HistoryGrammar:
    """An inner source whose mask depends on everything it has accepted: token t allowed iff (t + n) % 3 != 0,
    n = tokens accepted plus draft tokens. It records what it accepted and how often it was asked."""

    def __init__(self, vocab: int = V) -> None:
        self.vocab = vocab
        self.accepted: list[int] = []
        self.asked = 0

    def allowed(self, n: int) -> np.ndarray:
        return (np.arange(self.vocab) + n) % 3 != 0

    def fill_bitmask(self, row: np.ndarray, draft_path: Sequence[int]) -> bool:
        self.asked += 1
        row[:] = ref.pack_bitmask(self.allowed(len(self.accepted) + len(draft_path))[None, :])[0]
        return True

    def accept_token(self, token_id: int) -> None:
        self.accepted.append(int(token_id))

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens:]

    def jump_forward(self, output_token_ids: Sequence[int]) -> None:
        return None


def ends_with(seq: Sequence[int], suffix: Sequence[int]) -> bool:
    return len(seq) >= len(suffix) and list(seq[len(seq) - len(suffix):]) == list(suffix)


def reference_mode(out: Sequence[int], begin: Sequence[int], end: Sequence[int], budget: int | None,
                   starts: bool) -> tuple[str, object]:
    """What the think budget must do for the token after ``out``, by plain searching (no automaton):
    ('free', None), ('forced', token) or ('inner', tokens after the end marker)."""
    if starts:
        s = 0
    else:
        hits = [i for i in range(len(begin), len(out) + 1) if ends_with(out[:i], begin)]
        if not hits:
            return "free", None
        s = hits[0]
    ends = [e for e in range(s + len(end), len(out) + 1) if ends_with(out[s:e], end)]
    if ends:
        return "inner", list(out[ends[0]:])
    if budget is not None and len(out) - s >= budget:
        j = max(j for j in range(len(end)) if ends_with(out[s:], end[:j]))
        return "forced", end[j]
    return "free", None


def expected_allowed(mode: str, arg: object) -> set[int]:
    if mode == "free":
        return set(range(V))
    if mode == "forced":
        return {int(arg)}  # type: ignore[arg-type]
    return set(np.flatnonzero(HistoryGrammar().allowed(len(arg))).tolist())  # type: ignore[arg-type]


# ---- random runs through the real pipeline ----------------------------------------------------------------------

@pytest.mark.parametrize("begin, end", [([1, 2], [3, 4]), ([1], [3, 3, 4]), ([5, 6, 5], [7])])
def test_random_runs_respect_the_budget_force_the_marker_and_gate_the_inner_source(proc, sampler, begin,
                                                                                   end) -> None:
    rng = np.random.default_rng(sum(begin) * 7 + len(end))
    budgets = [0, 1, 2, 3, 5, 8, 13, None]
    specs = [(budgets[i % len(budgets)], i % 3 == 0) for i in range(24)]
    marker_bias = {t: 3.0 for t in set(begin) | set(end)}
    states, thinks, inners = [], [], []
    for i, (budget, starts) in enumerate(specs):
        inner = HistoryGrammar()
        think = ThinkBudget(begin, end, budget, inner=inner, starts_in_thinking=starts)
        cfg = GenerationConfig(seed=i, logit_bias=marker_bias, temperature=[1.0, 0.0, 1.5][i % 3] if i % 5 else 1.0)
        states.append(RequestState([0], cfg, mask_sources=[think]))
        thinks.append(think)
        inners.append(inner)
    forced_seen = natural_end_seen = 0
    for _ in range(36):
        modes = [reference_mode(s.output_token_ids, begin, end, b, st) for s, (b, st) in zip(states, specs,
                                                                                            strict=True)]
        asked_before = [g.asked for g in inners]
        logits = (rng.standard_normal((len(states), V)) * 2).astype(np.float32)
        proc.inplace_update_logits(logits, states)
        for r, (mode, arg) in enumerate(modes):
            assert set(np.flatnonzero(np.isfinite(logits[r])).tolist()) == expected_allowed(mode, arg), (r, mode)
            assert (inners[r].asked > asked_before[r]) == (mode == "inner")  # consulted only after thinking
            assert thinks[r].forcing == (mode == "forced")
        probs = sampler.renormalize(proc.compute_probs_from_logits(logits, states), states)
        result = sampler.sample(probs, states)
        assert not result.no_valid_token.any()
        for r, (state, token) in enumerate(zip(states, result.token_ids.tolist(), strict=True)):
            if modes[r][0] == "forced":
                assert token == modes[r][1]
                forced_seen += 1
            state.append_token(token)
    for state, think, inner, (budget, starts) in zip(states, thinks, inners, specs, strict=True):
        out = state.output_token_ids
        mode, post = reference_mode(out, begin, end, budget, starts)
        assert inner.accepted == (post if mode == "inner" else [])  # the inner source saw only later tokens
        assert (think.phase == DONE) == (mode == "inner")
        if mode == "inner":
            s = 0 if starts else next(i for i in range(len(out) + 1) if ends_with(out[:i], begin))
            e = len(out) - len(post)
            if budget is not None:
                assert e - len(end) - s <= budget  # thinking text between the markers
            natural_end_seen += budget is None or e - s <= budget  # no token of it was forced
    assert forced_seen > 0  # the budget ran out
    assert natural_end_seen > 0 or len(end) > 2  # and thinking also ended on its own (rare for a 3-token marker)
    assert sum(t.phase == DONE for t in thinks) >= len(thinks) // 3


def test_the_end_marker_is_forced_exactly_when_the_budget_runs_out() -> None:
    think = ThinkBudget([100], [7, 8, 9], 3, starts_in_thinking=False)
    row = np.empty(4, np.int32)
    for t in [5, 100, 11, 12]:
        assert not think.fill_bitmask(row, ())
        think.accept_token(t)
    assert think.phase == THINKING and think.thinking_tokens == 2
    think.accept_token(13)
    for t in [7, 8, 9]:
        assert think.fill_bitmask(row, ())
        assert np.flatnonzero(ref.unpack_bitmask(row[None, :], 128)[0]).tolist() == [t]
        think.accept_token(t)
    assert think.phase == DONE and not think.fill_bitmask(row, ())  # no inner source: unconstrained


def test_a_partial_end_marker_is_completed_not_repeated() -> None:
    think = ThinkBudget([1], [5, 5, 6], 4, starts_in_thinking=True)
    row = np.empty(1, np.int32)
    for t in [9, 5, 5, 5]:  # KMP: '5 5' still matches the first two marker tokens after '5 5 5'
        think.accept_token(t)
    assert think.fill_bitmask(row, ())
    assert np.flatnonzero(ref.unpack_bitmask(row[None, :], 32)[0]).tolist() == [6]
    think.accept_token(6)
    assert think.phase == DONE


def test_budget_zero_forces_the_marker_right_after_the_begin_marker() -> None:
    inner = HistoryGrammar()
    think = ThinkBudget([1, 2], [3], 0, inner=inner)
    row = np.empty(2, np.int32)
    for t in [1, 1, 2]:
        think.accept_token(t)
    assert think.forcing and think.fill_bitmask(row, ())
    assert np.flatnonzero(ref.unpack_bitmask(row[None, :], 64)[0]).tolist() == [3]
    think.accept_token(3)
    assert inner.accepted == [] and inner.asked == 0
    think.accept_token(1)
    think.accept_token(2)  # a second begin marker is ordinary output for the inner source
    assert inner.accepted == [1, 2] and think.phase == DONE


# ---- drafts -----------------------------------------------------------------------------------------------------

def test_draft_paths_give_the_masks_of_committing_on_a_copy() -> None:
    rng = np.random.default_rng(2)
    begin, end = [1, 2], [3, 3, 4]
    chunks = [[1], [2], [3], [4], [5], [9], [10], begin, end, end[:2]]

    def stream(max_chunks: int) -> list[int]:
        return [t for i in rng.integers(0, len(chunks), int(rng.integers(0, max_chunks))) for t in chunks[i]]

    row, expected = np.empty(2, np.int32), np.empty(2, np.int32)
    crossed = forced = 0
    for trial in range(400):
        budget = [None, 0, 2, 4][trial % 4]
        think = ThinkBudget(begin, end, budget, inner=HistoryGrammar(), starts_in_thinking=trial % 3 == 0)
        for t in stream(6):
            think.accept_token(t)
        before = (think.phase, think.thinking_tokens, think.forcing, len(think.inner.accepted), think.inner.asked)
        draft = stream(5)
        row[:] = -1
        got = think.fill_bitmask(row, draft)
        asked = think.inner.asked - before[-1]
        assert (think.phase, think.thinking_tokens, think.forcing, len(think.inner.accepted)) == before[:-1]
        other = copy.deepcopy(think)
        for t in draft:
            other.accept_token(t)
        expected[:] = -1
        assert other.fill_bitmask(expected, ()) == got
        np.testing.assert_array_equal(row, expected)
        assert asked == (other.phase == DONE)  # the inner source is asked only about post-thinking positions
        crossed += other.phase == DONE and think.phase != DONE
        forced += other.forcing
    assert crossed > 20 and forced > 20  # drafts that end thinking, and drafts that run into the budget


def test_draft_trees_through_the_processor(proc) -> None:
    think = ThinkBudget([1], [3], 2, inner=HistoryGrammar())
    fin = FinishedSequenceMask([39])
    state = RequestState([0], GenerationConfig(), mask_sources=[think, fin])
    for t in [1, 8]:
        state.append_token(t)
    tree = DraftTree((9, 3, 3, 5, 39, 6), (-1, -1, 0, 1, 3, 4))
    logits = np.zeros((1 + len(tree.token_ids), V), np.float32)
    proc.inplace_update_logits(logits, [state], draft_trees=[tree])
    paths = [[]] + [tree.path(n) for n in range(len(tree.token_ids))]
    for r, path in enumerate(paths):
        out = [1, 8, *path]
        allowed = expected_allowed(*reference_mode(out, [1], [3], 2, False))
        if 39 in path:
            allowed &= {39}
        assert set(np.flatnonzero(np.isfinite(logits[r])).tolist()) == allowed, path
    assert think.phase == THINKING and think.thinking_tokens == 1 and not fin.finished


# ---- errors -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (([1], [], 3), "end_ids must hold at least one token id"),
    (([], [2], 3), "begin_ids must hold at least one token id"),
    (([1], [2], -1), "max_thinking_tokens must be None or an int >= 0"),
    (([1], [2], True), "max_thinking_tokens must be None or an int >= 0"),
    (([1], [2], 2.0), "max_thinking_tokens must be None or an int >= 0"),
    (([1], [-2], 2), r"end_ids: token ids must be ints >= 0, got -2"),
    (([1.0], [2], 2), r"begin_ids: token ids must be ints >= 0, got 1.0"),
])
def test_think_budget_arguments_are_checked(args, message) -> None:
    with pytest.raises(ValueError, match=message):
        ThinkBudget(*args)


def test_starts_in_thinking_needs_no_begin_marker_and_the_row_must_hold_the_marker() -> None:
    think = ThinkBudget([], [100], 0, starts_in_thinking=True)
    with pytest.raises(ValueError, match="outside the bitmask row"):
        think.fill_bitmask(np.empty(3, np.int32), ())


# ---- finished sequences -----------------------------------------------------------------------------------------

def test_finished_sequences_allow_only_eos() -> None:
    mask = FinishedSequenceMask([999, 1, 33, 1])
    row = np.full(32, -1, np.int32)
    assert not mask.fill_bitmask(row, ()) and not mask.fill_bitmask(row, [5, 6])
    assert mask.fill_bitmask(row, [5, 33, 6])  # a draft that ends the sequence
    assert not mask.finished
    assert np.flatnonzero(ref.unpack_bitmask(row[None, :], 1000)[0]).tolist() == [1, 33, 999]
    mask.accept_token(7)
    assert not mask.finished
    mask.accept_token(999)
    assert mask.finished and mask.fill_bitmask(row, ())
    assert np.flatnonzero(ref.unpack_bitmask(row[None, :], 1000)[0]).tolist() == [1, 33, 999]
    other = FinishedSequenceMask(4)
    other.finish()
    assert other.fill_bitmask(row, ()) and np.flatnonzero(ref.unpack_bitmask(row[None, :], 1000)[0]).tolist() == [4]
    with pytest.raises(ValueError, match="outside the bitmask row"):
        mask.fill_bitmask(np.empty(2, np.int32), ())
    for bad in ([], [-1], [True], ["2"]):
        with pytest.raises(ValueError, match="eos_ids"):
            FinishedSequenceMask(bad)


def test_a_multi_sequence_request_keeps_finished_sequences_on_eos(proc, sampler) -> None:
    eos = [2, 37]
    masks = [FinishedSequenceMask(eos) for _ in range(6)]
    states = [RequestState([0, 1], GenerationConfig(seed=i, temperature=[1.0, 0.0][i % 2]), mask_sources=[m])
              for i, m in enumerate(masks)]
    masks[1].finish()
    masks[4].finish()
    rng = np.random.default_rng(4)
    for step in range(12):
        logits = (rng.standard_normal((len(states), V)) * 3).astype(np.float32)
        logits[:, 2] -= 3.0  # running sequences rarely pick an EOS on their own
        finished = [m.finished for m in masks]
        proc.inplace_update_logits(logits, states)
        probs = sampler.renormalize(proc.compute_probs_from_logits(logits, states), states)
        result = sampler.sample(probs, states)
        for i, (state, token) in enumerate(zip(states, result.token_ids.tolist(), strict=True)):
            if finished[i]:
                assert token in eos and set(np.flatnonzero(probs[i]).tolist()) <= set(eos)
            state.append_token(token)
        if step == 3:
            masks[0].finish()
    assert masks[0].finished and masks[1].finished and masks[4].finished
    outs = [s.output_token_ids for s in states]
    assert all(t in eos for t in outs[1]) and all(t in eos for t in outs[0][4:])
    assert any(t not in eos for t in outs[3])  # the others go on
