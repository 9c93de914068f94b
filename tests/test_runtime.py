"""LogitProcessor and Sampler against the numpy pipeline: each stage, mixed batches, drafts, seeds, bad input."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from logitproc import GenerationConfig, LogitProcessor, RequestState, Sampler
from logitproc.compile import build_kernels
from logitproc.runtime import BatchUpdate, DraftTree, empty_aligned
from logitproc.tir_kernels import reference as ref
from pipeline_reference import process_row

V = 1003  # not a multiple of 32


class AllowedSet:
    """A mask source allowing a fixed set of tokens, plus (to test drafts) the tokens after each draft token + 1."""

    def __init__(self, allowed: Sequence[int], vocab: int = V) -> None:
        self.allowed = np.zeros(vocab, bool)
        self.allowed[list(allowed)] = True
        self.accepted: list[int] = []

    def allowed_after(self, path: Sequence[int]) -> np.ndarray:
        allowed = self.allowed.copy()
        for t in path:
            allowed[(t + 1) % allowed.size] = True
        return allowed

    def fill_bitmask(self, row: np.ndarray, draft_path: Sequence[int]) -> bool:
        row[:] = ref.pack_bitmask(self.allowed_after(draft_path)[None, :])[0, : row.size]
        return True

    def accept_token(self, token_id: int) -> None:
        self.accepted.append(token_id)

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens:]

    def jump_forward(self, output_token_ids: Sequence[int]) -> None:
        return None


def logits_for(rows: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, V)) * 3).astype(np.float32)


def make_state(cfg: GenerationConfig, prompt: Sequence[int] = (5, 6, 7, 5), output: Sequence[int] = (9, 9, 11),
               sources: Sequence[object] = ()) -> RequestState:
    state = RequestState(prompt, cfg, mask_sources=sources)
    for t in output:
        state.append_token(t)
    return state


MIXED_CONFIGS = [
    GenerationConfig(),
    GenerationConfig(temperature=0.0),
    GenerationConfig(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3,
                     repetition_penalty=1.1, logit_bias={42: 5.0, 7: -100.0}),
    GenerationConfig(repetition_penalty=1.3),
    GenerationConfig(temperature=1.5, top_k=3),
    GenerationConfig(frequency_penalty=-1.0, presence_penalty=2.0, top_p=0.5),
    GenerationConfig(logit_bias={0: 100.0, 1002: -50.0}, min_p=0.2),
]


# ---- each stage, and all together, on a mixed batch -----------------------------------------------------------

@pytest.mark.parametrize("with_masks", [False, True])
def test_mixed_batch_matches_the_numpy_pipeline(proc, with_masks) -> None:
    states, expected_logits, expected_probs = [], [], []
    logits = logits_for(len(MIXED_CONFIGS))
    for i, cfg in enumerate(MIXED_CONFIGS):
        allowed = list(range(i, V, 3)) if with_masks and i % 2 else None
        sources = [AllowedSet(allowed)] if allowed is not None else []
        states.append(make_state(cfg, sources=sources))
        mask = sources[0].allowed if sources else None
        x, p = process_row(logits[i], cfg, states[-1].prompt_token_ids, states[-1].output_token_ids, mask)
        expected_logits.append(x)
        expected_probs.append(p)
    work = logits.copy()
    proc.inplace_update_logits(work, states)
    np.testing.assert_allclose(work, np.stack(expected_logits), rtol=1e-6, atol=1e-6)
    probs = proc.compute_probs_from_logits(work, states)
    probs = Sampler(build_kernels("cpu"), V).renormalize(probs, states)
    np.testing.assert_allclose(probs, np.stack(expected_probs), rtol=2e-5, atol=1e-7)


def test_stages_with_nothing_to_do_leave_logits_bit_identical(proc) -> None:
    logits = logits_for(3)
    work = logits.copy()
    proc.inplace_update_logits(work, [make_state(GenerationConfig()) for _ in range(3)])
    np.testing.assert_array_equal(work, logits)


def test_unaligned_and_aligned_numpy_inputs_agree(proc) -> None:
    states = [make_state(MIXED_CONFIGS[2])]
    base = logits_for(1)
    unaligned = np.empty(V + 1, np.float32)[1:][None, :]  # offset by 4 bytes: staged through the aligned buffer
    unaligned[...] = base
    aligned = empty_aligned((1, V))
    aligned[...] = base
    proc.inplace_update_logits(unaligned, states)
    proc.inplace_update_logits(aligned, states)
    np.testing.assert_array_equal(unaligned, aligned)
    assert not np.array_equal(aligned, base)


# ---- the step's Batch -------------------------------------------------------------------------------------------

def test_a_batch_says_which_sequences_joined_left_and_moved(lib) -> None:
    proc = LogitProcessor(lib, vocab_size=V, max_num_token=8)
    a, b, c = (make_state(GenerationConfig()) for _ in range(3))
    first = proc.batch([a, b])
    assert (first.update.joined, first.update.left, first.update.moved) == ((a, b), (), ())
    second = proc.batch([b, c])
    assert (second.update.joined, second.update.left, second.update.moved) == ((c,), (a,), ((b, 0),))
    assert proc.batch([b, c]).update == BatchUpdate()


def test_penalties_follow_their_sequence_when_rows_change_and_sequences_leave(lib) -> None:
    proc = LogitProcessor(lib, vocab_size=V, max_num_token=8)
    penalised = make_state(GenerationConfig(presence_penalty=2.0), prompt=(1,), output=(7,))
    plain = make_state(GenerationConfig(), prompt=(1,), output=(7,))
    logits = logits_for(2)
    for order in ([penalised, plain], [plain, penalised], [plain]):
        work = logits[: len(order)].copy()
        proc.inplace_update_logits(work, order)
        for r, state in enumerate(order):
            shift = 2.0 if state is penalised else 0.0
            assert work[r, 7] == pytest.approx(logits[r, 7] - shift)  # 7 is in the output: presence penalty


def test_one_batch_serves_every_stage_of_a_step(lib, proc, sampler) -> None:
    """The processor's batch goes to every stage; the processor refuses a batch another processor made."""
    states = [make_state(MIXED_CONFIGS[i]) for i in range(3)]
    logits = logits_for(3)
    batch = proc.batch(states)
    proc.inplace_update_logits(logits, batch)
    probs = sampler.renormalize(proc.compute_probs_from_logits(logits, batch), batch)
    result = sampler.sample(probs, batch)
    assert result.token_ids.shape == (3,) and not result.no_valid_token.any()
    other = LogitProcessor(lib, vocab_size=V, max_num_token=4)
    with pytest.raises(ValueError, match="made by another LogitProcessor"):
        other.inplace_update_logits(logits, batch)
    with pytest.raises(ValueError, match="rows"):
        proc.inplace_update_logits(logits[:2], batch)


# ---- masks -----------------------------------------------------------------------------------------------------

def test_masked_tokens_are_never_sampled_and_have_probability_zero(proc, sampler) -> None:
    allowed = [3, 500, 1002]
    states = [make_state(GenerationConfig(seed=s), sources=[AllowedSet(allowed)]) for s in range(8)]
    logits = logits_for(8)
    proc.inplace_update_logits(logits, states)
    probs = proc.compute_probs_from_logits(logits, states)
    mask = np.zeros(V, bool)
    mask[allowed] = True
    assert np.all(probs[:, ~mask] == 0)
    result = sampler.sample(sampler.renormalize(probs, states), states)
    assert set(result.token_ids.tolist()) <= set(allowed)


def test_a_row_with_every_token_masked_never_yields_nan_or_a_token(proc, sampler) -> None:
    cfgs = [GenerationConfig(top_p=0.9, logprobs=True, top_logprobs=2), GenerationConfig(temperature=0.0),
            GenerationConfig(seed=3)]
    states = [make_state(c, sources=[AllowedSet([])] if i == 1 else []) for i, c in enumerate(cfgs)]
    logits = logits_for(3)
    proc.inplace_update_logits(logits, states)
    probs = sampler.renormalize(proc.compute_probs_from_logits(logits, states), states)
    assert not np.isnan(probs).any() and np.all(probs[1] == 0)
    result = sampler.sample(probs, states)
    assert result.token_ids[1] == -1 and result.no_valid_token.tolist() == [False, True, False]
    assert result.finish_reason(1) == "no_valid_token" and result.finish_reason(0) is None
    assert 0 <= result.token_ids[0] < V and 0 <= result.token_ids[2] < V
    assert np.isfinite(result.logprobs[0])


class FailingSource(AllowedSet):
    """A mask source whose mask computation fails (an engine bug, a grammar past its limits)."""

    def fill_bitmask(self, row: np.ndarray, draft_path: Sequence[int]) -> bool:
        raise RuntimeError("grammar engine gave up")


@pytest.mark.parametrize("workers_start", [False, True])
def test_a_failing_mask_source_ends_its_row_alone(proc, sampler, workers_start) -> None:
    """The failing row allows nothing (no NaN, no token) and records why; the other rows are as without it."""
    cfgs = [GenerationConfig(seed=1), GenerationConfig(temperature=0.0), GenerationConfig(seed=2)]
    sources = [[AllowedSet([4, 8, 15])], [FailingSource([])], [AllowedSet([16, 23, 42])]]
    states = [make_state(c, sources=s) for c, s in zip(cfgs, sources, strict=True)]
    logits = logits_for(3)
    if workers_start:
        proc.start_masks(states)
    batch = proc.inplace_update_logits(logits, states)
    result = sampler.sample(sampler.renormalize(proc.compute_probs_from_logits(logits, batch), batch), batch)
    assert result.no_valid_token.tolist() == [False, True, False]
    assert batch.mask_errors == {1: "RuntimeError: grammar engine gave up"}  # the error travels on the step's job
    assert result.token_ids[0] in (4, 8, 15) and result.token_ids[2] in (16, 23, 42)
    assert np.all(np.isneginf(logits[1])) and not np.isnan(logits).any()


# ---- drafts -----------------------------------------------------------------------------------------------------

def state_snapshot(state: RequestState) -> tuple:
    return (list(state.output_token_ids), state.appeared_token_ids.tolist(), state.output_counts.tolist(),
            [list(s.accepted) for s in state.mask_sources if isinstance(s, AllowedSet)])


@pytest.mark.parametrize("tree", [
    DraftTree.chain([9, 100, 9, 5]),
    DraftTree((9, 100, 12, 9, 900), (-1, 0, 0, 1, -1)),  # a tree: two children of node 0, a second root branch
])
def test_processing_with_drafts_equals_each_prefix_alone_and_restores_state(proc, tree) -> None:
    cfgs = [MIXED_CONFIGS[2], GenerationConfig(repetition_penalty=1.5, presence_penalty=1.0)]
    states = [make_state(c, sources=[AllowedSet(range(0, V, 2))]) for c in cfgs]
    before = [state_snapshot(s) for s in states]
    rows = 2 * (1 + len(tree.token_ids))
    logits = logits_for(rows, seed=4)
    work = logits.copy()
    cum = [0, rows // 2, rows]
    batch = proc.inplace_update_logits(work, states, cum_num_token=cum, draft_trees=[tree, tree])
    probs = proc.compute_probs_from_logits(work, states, cum, [tree, tree]).copy()
    assert [state_snapshot(s) for s in states] == before
    for r in range(rows):
        state = batch.row_states[r]
        alone = make_state(state.config, state.prompt_token_ids, state.output_token_ids + list(batch.paths[r]),
                           sources=[AllowedSet(range(0, V, 2))])
        source = state.mask_sources[0]
        single = logits[r : r + 1].copy()
        alone.mask_sources[0].allowed = source.allowed_after(batch.paths[r])
        proc.inplace_update_logits(single, [alone])
        np.testing.assert_allclose(work[r], single[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(probs[r], proc.compute_probs_from_logits(single, [alone])[0], rtol=1e-6,
                                   atol=1e-8)


def test_a_chain_on_the_state_is_used_when_no_drafts_are_passed(proc) -> None:
    state = make_state(GenerationConfig(frequency_penalty=1.0))
    state.draft_token_ids = [50, 50]
    logits = logits_for(3)
    work = logits.copy()
    batch = proc.inplace_update_logits(work, [state])
    assert batch.paths == ((), (50,), (50, 50))
    assert work[1, 50] == pytest.approx(logits[1, 50] - 1.0) and work[2, 50] == pytest.approx(logits[2, 50] - 2.0)


def test_draft_row_counts_must_match(proc) -> None:
    with pytest.raises(ValueError, match="cum_num_token"):
        proc.inplace_update_logits(logits_for(2), [make_state(GenerationConfig())], cum_num_token=[0, 2])
    with pytest.raises(ValueError, match="parents"):
        DraftTree((1, 2), (-1, 1))
    with pytest.raises(ValueError, match="logits has 1 rows"):
        proc.inplace_update_logits(logits_for(1), [make_state(GenerationConfig())], draft_trees=[[4]])


# ---- seeds and greedy -------------------------------------------------------------------------------------------

def sample_tokens(proc: LogitProcessor, sampler: Sampler, cfgs: list[GenerationConfig], logits: np.ndarray,
                  steps: int, track: int) -> list[int]:
    states = [RequestState([1, 2, 3], c) for c in cfgs]
    out = []
    for _ in range(steps):
        work = logits.copy()
        proc.inplace_update_logits(work, states)
        probs = sampler.renormalize(proc.compute_probs_from_logits(work, states), states)
        result = sampler.sample(probs, states)
        for s, t in zip(states, result.token_ids, strict=True):
            s.append_token(int(t))
        out.append(int(result.token_ids[track]))
    return out


def test_a_seed_gives_the_same_tokens_whatever_the_batch_and_row(proc, sampler) -> None:
    seeded = GenerationConfig(temperature=1.2, top_p=0.95, seed=1234, presence_penalty=0.3)
    logits = np.tile(logits_for(1, seed=9), (5, 1))
    alone = sample_tokens(proc, sampler, [seeded], logits[:1], 12, 0)
    others = [GenerationConfig(), GenerationConfig(temperature=0.0), GenerationConfig(seed=7, top_k=5),
              GenerationConfig(temperature=2.0)]
    in_batch = sample_tokens(proc, sampler, others[:2] + [seeded] + others[2:], logits, 12, 2)
    assert alone == in_batch
    assert len(set(alone)) > 1  # it really samples


@pytest.mark.parametrize("drawn, kept", [(1, 1), (1, 0), (4, 0), (4, 2), (4, 4), (7, 3)])
def test_kept_draws_leave_the_stream_where_drawing_only_those_would(drawn: int, kept: int) -> None:
    """A step's draws for its rows (a verify checks drafts: one per row), then only the committed rows' kept: the
    stream goes on exactly as one that drew only those; draw / keep / draw again gives the same numbers."""
    state, shadow = (RequestState([1, 2], GenerationConfig(temperature=1.0, seed=99)) for _ in range(2))
    first = state.draw_uniforms(drawn)
    assert first.dtype == np.float32 and first.shape == (drawn,) and ((0 <= first) & (first < 1)).all()
    state.keep_draws(kept)
    state.keep_draws(kept)  # settled: nothing left to give back
    expected = shadow.draw_uniforms(kept + 5)
    assert np.array_equal(first[:kept], expected[:kept])
    assert np.array_equal(state.draw_uniforms(5), expected[kept:])


def test_keeping_more_draws_than_were_made_is_refused_and_nothing_drawn_keeps_nothing() -> None:
    state = RequestState([1], GenerationConfig(seed=5))
    state.keep_draws(3)  # no draws pending (a greedy sequence draws nothing): nothing to do
    state.draw_uniforms(2)
    with pytest.raises(ValueError, match=r"keep_draws: count must be in \[0, 2\]"):
        state.keep_draws(3)


def test_temperature_zero_is_greedy_and_takes_the_lowest_id_on_ties(proc, sampler) -> None:
    logits = logits_for(1)
    logits[0, [17, 400]] = logits.max() + 2
    tokens = sample_tokens(proc, sampler, [GenerationConfig(temperature=0.0)], logits, 3, 0)
    assert tokens == [17, 17, 17]


def test_sampling_frequencies_follow_the_probabilities(lib) -> None:
    vocab = 5
    sampler = Sampler(lib, vocab_size=vocab, max_num_token=256)
    p = np.array([[0.1, 0.0, 0.4, 0.2, 0.3]], np.float32)
    states = [RequestState([0], GenerationConfig(seed=i)) for i in range(256)]
    counts = np.zeros(vocab)
    for _ in range(20):
        result = sampler.sample(np.repeat(p, 256, axis=0), states)
        counts += np.bincount(result.token_ids, minlength=vocab)
    freq = counts / counts.sum()
    assert counts[1] == 0
    np.testing.assert_allclose(freq, p[0], atol=0.02)


# ---- logprobs ---------------------------------------------------------------------------------------------------

def test_processed_and_raw_logprobs(proc, sampler) -> None:
    cfg_processed = GenerationConfig(temperature=0.5, top_k=3, logprobs=True, top_logprobs=3, seed=1)
    cfg_raw = GenerationConfig(temperature=0.5, top_k=3, logprobs=True, top_logprobs=3, seed=1,
                               logprobs_mode="raw")
    states = [RequestState([1], cfg_processed), RequestState([1], cfg_raw)]
    logits = np.tile(logits_for(1, seed=2), (2, 1))
    raw = logits.copy()
    proc.inplace_update_logits(logits, states)
    probs = sampler.renormalize(proc.compute_probs_from_logits(logits, states), states)
    final = probs.copy()
    result = sampler.sample(probs, states, raw_logits=raw)
    t = result.token_ids
    assert t[0] == t[1]
    assert result.logprobs[0] == pytest.approx(math.log(final[0, t[0]]), rel=1e-5)
    raw_log_softmax = raw[1].astype(np.float64) - np.log(np.exp(raw[1].astype(np.float64)).sum())
    assert result.logprobs[1] == pytest.approx(raw_log_softmax[t[1]], rel=1e-5)
    top_raw = np.argsort(-raw_log_softmax, kind="stable")[:3]
    assert [tok for tok, _ in result.top_logprobs[1]] == top_raw.tolist()
    top_processed = np.argsort(-final[0], kind="stable")[:3]
    assert [tok for tok, _ in result.top_logprobs[0]] == top_processed.tolist()
    with pytest.raises(ValueError, match="raw_logits"):
        sampler.sample(probs, states)


def test_auto_logprobs_are_raw_when_greedy_and_processed_when_sampling(proc, sampler) -> None:
    """The default mode, "auto": a greedy row reports the model's distribution (its processed one would be 0 for the
    chosen token and -inf elsewhere), a sampled row the distribution it was drawn from."""
    greedy = GenerationConfig(temperature=0.0, logprobs=True, top_logprobs=3)
    sampled = GenerationConfig(temperature=0.5, top_k=3, logprobs=True, top_logprobs=3, seed=1)
    assert (greedy.logprobs_mode, greedy.effective_logprobs_mode, sampled.effective_logprobs_mode) == (
        "auto", "raw", "processed")
    states = [RequestState([1], greedy), RequestState([1], sampled)]
    logits = np.tile(logits_for(1, seed=3), (2, 1))
    raw = logits.copy()
    proc.inplace_update_logits(logits, states)
    probs = sampler.renormalize(proc.compute_probs_from_logits(logits, states), states)
    final = probs.copy()
    result = sampler.sample(probs, states, raw_logits=raw)
    raw_log_softmax = raw[0].astype(np.float64) - np.log(np.exp(raw[0].astype(np.float64)).sum())
    t = result.token_ids
    assert t[0] == int(np.argmax(raw[0]))
    assert result.logprobs[0] == pytest.approx(raw_log_softmax[t[0]], rel=1e-5) and result.logprobs[0] < 0
    assert [tok for tok, _ in result.top_logprobs[0]] == np.argsort(-raw_log_softmax, kind="stable")[:3].tolist()
    assert [lp for _, lp in result.top_logprobs[0]] == pytest.approx(
        np.sort(raw_log_softmax)[::-1][:3].tolist(), rel=1e-5)
    assert result.logprobs[1] == pytest.approx(math.log(final[1, t[1]]), rel=1e-5)
    with pytest.raises(ValueError, match="'auto' on a greedy request"):
        sampler.sample(probs, states)


# ---- bad input --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"temperature": -0.1}, ValueError, r"temperature must be in \[0.0, inf\], got -0.1"),
    ({"temperature": float("nan")}, ValueError, "temperature must be finite, got nan"),
    ({"top_p": 0.0}, ValueError, r"top_p must be in \(0.0, 1.0\], got 0.0"),
    ({"top_p": 1.5}, ValueError, "top_p"),
    ({"top_k": -2}, ValueError, "top_k must be -1 or 0"),
    ({"top_k": 2.5}, TypeError, "top_k must be an int"),
    ({"min_p": 1.01}, ValueError, "min_p"),
    ({"presence_penalty": 2.5}, ValueError, r"presence_penalty must be in \[-2.0, 2.0\], got 2.5"),
    ({"frequency_penalty": float("inf")}, ValueError, "frequency_penalty must be finite"),
    ({"repetition_penalty": 0.0}, ValueError, "repetition_penalty"),
    ({"logit_bias": {5: 101.0}}, ValueError, r"logit_bias\[5\] must be in \[-100.0, 100.0\], got 101.0"),
    ({"logit_bias": {-1: 1.0}}, ValueError, r"logit_bias token id must be in \[0, 2147483647\]"),
    ({"logit_bias": [1, 2]}, TypeError, "logit_bias must be a mapping"),
    ({"logit_bias": {"x": 1.0}}, TypeError, "logit_bias key 'x'"),
    ({"top_logprobs": 21, "logprobs": True}, ValueError, r"top_logprobs must be in \[0, 20\], got 21"),
    ({"top_logprobs": 2}, ValueError, "needs logprobs=True"),
    ({"logprobs_mode": "final"}, ValueError, "logprobs_mode"),
    ({"seed": -1}, ValueError, "seed"),
    ({"temperature": True}, TypeError, "temperature must be a number"),
    ({"max_tokens": 0}, ValueError, "max_tokens"),
])
def test_bad_configs_name_the_field_and_value(kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        GenerationConfig(**kwargs)


def test_logit_bias_keys_from_json_are_accepted() -> None:
    assert dict(GenerationConfig(logit_bias={"42": 5}).logit_bias) == {42: 5.0}


def test_bad_calls_are_clear_errors_and_do_not_touch_other_requests(proc) -> None:
    good = make_state(GenerationConfig(presence_penalty=1.0))
    bad = make_state(GenerationConfig(logit_bias={V + 5: 1.0}))
    before = state_snapshot(good)
    logits = logits_for(2)
    work = logits.copy()
    with pytest.raises(ValueError, match=f"logit_bias token id {V + 5} is outside the vocabulary"):
        proc.inplace_update_logits(work, [good, bad])
    np.testing.assert_array_equal(work, logits)
    assert state_snapshot(good) == before
    with pytest.raises(ValueError, match="exceed max_num_token=64"):
        proc.inplace_update_logits(logits_for(65), [make_state(GenerationConfig()) for _ in range(65)])
    other = make_state(GenerationConfig())
    with pytest.raises(TypeError, match="logits must be float32"):
        proc.inplace_update_logits(logits.astype(np.float64), [good, other])
    with pytest.raises(ValueError, match=r"shape \[num_rows, 1003\]"):
        proc.inplace_update_logits(logits[:, :10].copy(), [good, other])
    with pytest.raises(ValueError, match=r"states\[0\] and states\[1\] are the same RequestState"):
        proc.inplace_update_logits(logits, [good, good])
    with pytest.raises(ValueError, match="states is empty"):
        proc.inplace_update_logits(logits, [])
    with pytest.raises(ValueError, match=r"prompt_token_ids: token ids must be in \[0, 2147483647\]"):
        RequestState([1, -2])
    with pytest.raises(ValueError, match="vocab_size must be an int >= 1"):
        LogitProcessor(build_kernels("cpu"), vocab_size=0, max_num_token=1)
    with pytest.raises(ValueError, match="penalty entries: the batch needs 10 entries, capacity is 4"):
        LogitProcessor(build_kernels("cpu"), vocab_size=V, max_num_token=2, max_penalty_entries=4) \
            .inplace_update_logits(logits, [good, make_state(GenerationConfig(repetition_penalty=1.2))])


def test_penalty_state_is_incremental() -> None:
    state = RequestState([3, 3, 4], GenerationConfig())
    for t in [4, 5, 4]:
        state.append_token(t)
    assert state.appeared_token_ids.tolist() == [3, 4, 5]
    assert state.output_counts.tolist() == [0, 2, 1]
    tokens, counts = state.penalty_entries([5, 6, 6])
    assert tokens.tolist() == [3, 4, 5, 6] and counts.tolist() == [0, 2, 2, 2]
    assert state.output_counts.tolist() == [0, 2, 1]


# ---- property: random configs and logits -----------------------------------------------------------------------

configs = st.builds(
    GenerationConfig,
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]),
    top_p=st.sampled_from([1.0, 0.95, 0.6, 0.1]),
    top_k=st.sampled_from([0, -1, 1, 5, 40]),
    min_p=st.sampled_from([0.0, 0.02, 0.3]),
    presence_penalty=st.floats(-2, 2, allow_nan=False),
    frequency_penalty=st.floats(-2, 2, allow_nan=False),
    repetition_penalty=st.floats(0.5, 2.0, allow_nan=False),
    logit_bias=st.dictionaries(st.integers(0, V - 1), st.floats(-100, 100, allow_nan=False), max_size=4),
    seed=st.integers(0, 2**32),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cfgs=st.lists(configs, min_size=1, max_size=6), seed=st.integers(0, 2**16),
       masked=st.lists(st.booleans(), min_size=6, max_size=6))
def test_property_pipeline_matches_reference_and_samples_allowed_tokens(proc, sampler, cfgs, seed, masked) -> None:
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((len(cfgs), V)) * 4).astype(np.float32)
    states, expected = [], []
    for i, cfg in enumerate(cfgs):
        prompt = rng.integers(0, V, 6).tolist()
        output = rng.integers(0, V, int(rng.integers(0, 8))).tolist()
        sources = [AllowedSet(rng.choice(V, 50, replace=False).tolist())] if masked[i] else []
        states.append(make_state(cfg, prompt, output, sources))
        expected.append(process_row(logits[i], cfg, prompt, output, sources[0].allowed if sources else None)[1])
    work = logits.copy()
    proc.inplace_update_logits(work, states)
    probs = sampler.renormalize(proc.compute_probs_from_logits(work, states), states)
    np.testing.assert_allclose(probs, np.stack(expected), rtol=1e-4, atol=1e-6)
    result = sampler.sample(probs, states)
    for r, t in enumerate(result.token_ids):
        assert probs[r, t] > 0


# ---- the incremental penalty layout ------------------------------------------------------------------------------

@pytest.mark.parametrize("capacity", [None, 300])  # 300: segments move and the layout is rebuilt along the way
def test_incremental_penalties_match_a_fresh_rebuild_as_the_batch_changes(lib, capacity) -> None:
    """Requests join, leave, change rows and grow over 40 steps; every step equals the numpy pipeline."""
    proc = LogitProcessor(lib, vocab_size=V, max_num_token=8, max_penalty_entries=capacity)
    rng = np.random.default_rng(11)
    pool = [make_state(GenerationConfig(presence_penalty=0.4, frequency_penalty=0.2, repetition_penalty=1.3),
                       prompt=rng.integers(0, V, 10).tolist(), output=()) for _ in range(6)]
    pool.append(make_state(GenerationConfig(), output=()))  # no penalties: no entries
    for step in range(40):
        batch = [pool[i] for i in rng.permutation(len(pool))[: int(rng.integers(1, 6))]]
        logits = logits_for(len(batch), seed=step)
        work = logits.copy()
        proc.inplace_update_logits(work, batch)
        for r, state in enumerate(batch):
            expected, _ = process_row(logits[r], state.config, state.prompt_token_ids, state.output_token_ids)
            np.testing.assert_allclose(work[r], expected, rtol=1e-6, atol=1e-6, err_msg=f"step {step} row {r}")
        for state in batch:  # new and repeated tokens
            state.append_token(int(rng.integers(0, V)) if rng.random() < 0.6 else state.prompt_token_ids[0])


def test_incremental_penalties_on_vulkan_match_the_cpu(lib, device_kernels) -> None:
    if device_kernels["vulkan"] is None:
        pytest.skip("no vulkan device here")
    device, _ = device_kernels["vulkan"]
    vk = LogitProcessor(build_kernels("vulkan"), vocab_size=V, max_num_token=4, device=device,
                        max_penalty_entries=200)
    cpu = LogitProcessor(lib, vocab_size=V, max_num_token=4)
    rng = np.random.default_rng(5)
    states = [make_state(MIXED_CONFIGS[2], output=()), make_state(MIXED_CONFIGS[3], output=())]
    for step in range(12):
        batch = states[::-1] if step % 3 == 0 else states
        logits = logits_for(len(batch), seed=step)
        a, b = logits.copy(), logits.copy()
        vk.inplace_update_logits(a, batch)
        cpu.inplace_update_logits(b, batch)
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
        for s in states:
            s.append_token(int(rng.integers(0, V)))
