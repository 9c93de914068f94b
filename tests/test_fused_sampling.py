"""Sampler.sample_from_logits (the fused path) against the staged path: the same tokens and logprobs with the same
seeds (processed and raw, chosen token and top-n), on mixed batches with penalties, masks, drafts and greedy rows; the
engine's processing step always takes it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from logitproc import GenerationConfig, RequestState
from logitproc.serve.processing import process
from logitproc.tir_kernels import reference as ref

V = 1003  # not a multiple of 32


class AllowedSet:
    """A mask source allowing a fixed set of tokens."""

    def __init__(self, allowed: Sequence[int]) -> None:
        self.allowed = np.zeros(V, bool)
        self.allowed[list(allowed)] = True

    def fill_bitmask(self, row: np.ndarray, draft_path: Sequence[int]) -> bool:
        row[:] = ref.pack_bitmask(self.allowed[None, :])[0, : row.size]
        return True

    def accept_token(self, token_id: int) -> None:
        pass

    def rollback(self, num_tokens: int) -> None:
        pass

    def jump_forward(self, output_token_ids: Sequence[int]) -> None:
        return None


CONFIGS = [
    GenerationConfig(seed=1),
    GenerationConfig(temperature=0.0, logprobs=True, top_logprobs=3),
    GenerationConfig(temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3,
                     repetition_penalty=1.1, logit_bias={42: 5.0, 7: -100.0}, seed=2, logprobs=True, top_logprobs=20),
    GenerationConfig(repetition_penalty=1.3, seed=3, logprobs=True, top_logprobs=5),
    GenerationConfig(temperature=1.5, top_k=3, seed=4, logprobs=True, logprobs_mode="raw", top_logprobs=4),
    GenerationConfig(frequency_penalty=-1.0, presence_penalty=2.0, top_p=0.5, seed=5, logprobs=True, top_logprobs=2),
    GenerationConfig(logit_bias={0: 100.0, 1002: -50.0}, min_p=0.2, seed=6),
    GenerationConfig(temperature=1e-6, seed=7),
    GenerationConfig(top_p=1e-6, seed=8),
    GenerationConfig(top_k=1, seed=9),
]
#: Per config, the mask sources of its row: one row allows nothing, one a single token, one a few tokens.
SOURCES: list[list[object]] = [[], [], [AllowedSet(range(0, V, 3))], [AllowedSet([])], [], [AllowedSet([77])], [],
                               [AllowedSet([5, 6, 900])], [], []]


def make_states(configs: Sequence[GenerationConfig], sources: Sequence[list[object]]) -> list[RequestState]:
    states = []
    for cfg, source in zip(configs, sources, strict=True):
        state = RequestState([5, 6, 7, 5], cfg, mask_sources=source)
        for t in (9, 9, 11):
            state.append_token(t)
        states.append(state)
    return states


def run_steps(proc, sampler, states: list[RequestState], fused: bool, steps: int, seed: int, defer: bool = False):
    """``steps`` decoding steps; each step's tokens are appended (the penalties see them). Returns every result.
    ``defer``: the processor leaves the masks to the sampler (the engine's way; the staged path applies them)."""
    results = []
    for step in range(steps):
        logits = (np.random.default_rng(seed + step).standard_normal((len(states), V)) * 3).astype(np.float32)
        raw = logits.copy()
        batch = proc.inplace_update_logits(logits, proc.batch(states), defer_masks=defer)  # (its deferred masks)
        if fused:
            result = sampler.sample_from_logits(logits, batch, raw_logits=raw)
        else:
            result = sampler.sample(sampler.renormalize(proc.compute_probs_from_logits(logits, batch), batch), batch,
                                    raw_logits=raw)
        results.append(result)
        for s, t in zip(states, result.token_ids, strict=True):
            if t >= 0:
                s.append_token(int(t))
    return results


@pytest.mark.parametrize(("fused", "defer"), [(True, False), (True, True), (False, True)],
                         ids=["fused", "fused-reads-the-masks", "staged-after-deferring"])
@pytest.mark.parametrize("with_masks", [False, True])
@pytest.mark.parametrize("rows", [slice(0, 10), slice(1, 2), slice(0, 1), slice(3, 5)])
def test_same_tokens_and_logprobs_as_the_staged_path(proc, sampler, with_masks, rows, fused, defer) -> None:
    """Mixed batches (greedy, tiny temperature, top_p 1e-6, top_k 1, penalties, bias, masked rows) over 6 steps;
    masks applied by the processor, read by the fused kernel (deferred), or deferred and then applied by
    compute_probs_from_logits."""
    configs = CONFIGS[rows]
    sources = SOURCES[rows] if with_masks else [[] for _ in configs]
    staged = run_steps(proc, sampler, make_states(configs, sources), False, 6, 100)
    other = run_steps(proc, sampler, make_states(configs, sources), fused, 6, 100, defer)
    for a, b in zip(staged, other, strict=True):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_array_equal(a.no_valid_token, b.no_valid_token)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        assert a.top_logprobs == b.top_logprobs


def test_masked_tokens_are_never_sampled_and_a_fully_masked_row_gets_no_token(proc, sampler) -> None:
    allowed = [3, 500, 1002]
    states = [RequestState([1], GenerationConfig(seed=s), mask_sources=[AllowedSet(allowed if s else [])])
              for s in range(16)]
    for step in range(5):
        logits = (np.random.default_rng(step).standard_normal((16, V)) * 3).astype(np.float32)
        batch = proc.inplace_update_logits(logits, states, defer_masks=step % 2 == 1)
        result = sampler.sample_from_logits(logits, batch)
        assert result.token_ids[0] == -1 and result.finish_reason(0) == "no_valid_token"
        assert set(result.token_ids[1:].tolist()) <= set(allowed)


def test_processed_top_n_logprobs_are_the_log_of_the_largest_probabilities(proc, sampler) -> None:
    """Against numpy: the processed top-n of the fused path are the log of the n largest probabilities of the
    distribution sampled from (after top-p / top-k), in order; past the kept tokens, -inf."""
    states = [RequestState([1], GenerationConfig(seed=1, top_p=0.9, logprobs=True, top_logprobs=4)),
              RequestState([1], GenerationConfig(seed=2, top_k=2, logprobs=True, top_logprobs=3)),
              RequestState([1], GenerationConfig())]
    logits = (np.random.default_rng(0).standard_normal((3, V)) * 2).astype(np.float32)
    expected = ref.renormalize(ref.softmax_with_temperature(logits, np.ones(3, np.float32)), np.int32([0, 2, 0]),
                               np.float32([0.9, 1.0, 1.0]), np.zeros(3, np.float32))
    result = sampler.sample_from_logits(logits.copy(), proc.inplace_update_logits(logits, states))
    for r, k in ((0, 4), (1, 3)):
        order = np.argsort(-expected[r], kind="stable")[:k]
        ids = [t for t, _ in result.top_logprobs[r]]
        with np.errstate(divide="ignore"):
            np.testing.assert_allclose([v for _, v in result.top_logprobs[r]], np.log(expected[r, order]), rtol=1e-5)
        assert ids[:2] == order[:2].tolist()
        np.testing.assert_allclose(result.logprobs[r], np.log(expected[r, result.token_ids[r]]), rtol=1e-5)
    assert result.logprobs[1] == dict(result.top_logprobs[1])[result.token_ids[1]]  # top_k 2: among the top 3
    assert result.top_logprobs[1][2][1] == -np.inf  # top_k 2: a third token has probability 0
    assert result.top_logprobs[2] is None


@pytest.mark.parametrize("with_masks", [False, True])
def test_the_batch_instead_of_its_processed_batch_after_deferring_masks_is_refused(proc, sampler, with_masks) -> None:
    """After ``inplace_update_logits(defer_masks=True)`` the masks live in the returned ProcessedBatch only: every
    later stage given the plain Batch refuses it (it would sample without them), whether or not a row has a mask;
    given the ProcessedBatch, the masks hold. Once the staged path applied them, the Batch is accepted again."""
    sources: list[list[object]] = [[AllowedSet([3])] if with_masks else [], []]
    states = [RequestState([1], GenerationConfig(temperature=0.0), mask_sources=src) for src in sources]
    logits = (np.random.default_rng(0).standard_normal((2, V)) * 3).astype(np.float32)
    logits[0, 3] = -30.0  # the mask's only token would never win without the mask
    batch = proc.batch(states)
    processed = proc.inplace_update_logits(logits, batch, defer_masks=True)
    probs = np.full((2, V), 1.0 / V, np.float32)
    for call in (lambda: sampler.sample_from_logits(logits, batch), lambda: sampler.sample(probs, batch),
                 lambda: sampler.renormalize(probs, batch), lambda: proc.compute_probs_from_logits(logits, batch)):
        with pytest.raises(ValueError, match="defer_masks=True.*pass the ProcessedBatch"):
            call()
    fused = sampler.sample_from_logits(logits, processed)
    staged = sampler.sample(sampler.renormalize(proc.compute_probs_from_logits(logits, processed), batch), batch)
    np.testing.assert_array_equal(fused.token_ids, staged.token_ids)  # the masks applied, the Batch accepted after
    if with_masks:
        assert fused.token_ids[0] == 3
    kept = proc.inplace_update_logits(logits, proc.batch(states))  # masks written into the logits: no refusal
    assert sampler.sample_from_logits(logits, kept.batch).token_ids[0] == fused.token_ids[0]


@pytest.mark.parametrize("top_logprobs", [0, 3])
def test_the_engine_step_gives_the_staged_tokens_either_way(proc, sampler, top_logprobs) -> None:
    """serve.processing.process (always fused) gives the staged path's tokens and logprobs, with and without
    processed top-n logprobs."""
    configs = [GenerationConfig(seed=1, top_p=0.8), GenerationConfig(temperature=0.0),
               GenerationConfig(seed=2, logprobs=True, top_logprobs=top_logprobs)]
    expected = run_steps(proc, sampler, [RequestState([1], c) for c in configs], False, 3, 7)
    states = [RequestState([1], c) for c in configs]
    for step in range(3):
        logits = (np.random.default_rng(7 + step).standard_normal((3, V)) * 3).astype(np.float32)
        result = process(proc, sampler, proc.batch(states), logits)
        np.testing.assert_array_equal(result.token_ids, expected[step].token_ids)
        np.testing.assert_array_equal(result.logprobs, expected[step].logprobs)
        assert result.top_logprobs == expected[step].top_logprobs
        for s, t in zip(states, result.token_ids, strict=True):
            s.append_token(int(t))


def test_bad_logits_are_clear_errors(proc, sampler) -> None:
    states = [RequestState([1], GenerationConfig(seed=1)), RequestState([1], GenerationConfig(seed=2))]
    batch = proc.batch(states)
    with pytest.raises(ValueError, match="logits"):
        sampler.sample_from_logits(np.zeros((2, V + 1), np.float32), batch)
    with pytest.raises(ValueError, match="logits has 3 rows"):
        sampler.sample_from_logits(np.zeros((3, V), np.float32), batch)


def test_non_finite_logits_are_flagged_by_the_sampler_and_the_step(proc, sampler) -> None:
    """NaN and +inf rows are flagged by the fused kernel itself (token -1, no logprobs), so the engine step needs no
    pass of its own over the logits."""
    states = [RequestState([1], GenerationConfig(seed=s, top_p=0.9 if s % 2 else 1.0, logprobs=True,
                                                 top_logprobs=2 * (s % 2))) for s in range(4)]
    logits = (np.random.default_rng(1).standard_normal((4, V))).astype(np.float32)
    logits[0, 5] = np.nan
    logits[1, :] = np.nan
    logits[2, 9] = np.inf
    raw = sampler.sample_from_logits(logits.copy(), proc.batch(states))
    assert raw.token_ids[:3].tolist() == [-1, -1, -1] and 0 <= raw.token_ids[3] < V
    assert [raw.finish_reason(r) for r in range(4)] == ["non_finite_logits"] * 3 + [None]
    assert np.isnan(raw.logprobs[:3]).all() and raw.top_logprobs[1] is None and len(raw.top_logprobs[3]) == 2
    result = process(proc, sampler, proc.batch(states), logits)
    assert result.token_ids[:3].tolist() == [-1, -1, -1] and 0 <= result.token_ids[3] < V
    assert [result.finish_reason(r) for r in range(4)] == ["non_finite_logits"] * 3 + [None]


def test_on_vulkan_the_fused_path_gives_the_staged_tokens(device_kernels) -> None:
    """The runtime on Vulkan (lavapipe here): sample_from_logits equals the staged path on the same device."""
    if device_kernels["vulkan"] is None:
        pytest.skip("no vulkan device here")
    from logitproc import LogitProcessor, Sampler
    from logitproc.compile import build_kernels

    device, _ = device_kernels["vulkan"]
    lib = build_kernels("vulkan")
    proc = LogitProcessor(lib, vocab_size=V, max_num_token=16, device=device)
    sampler = Sampler(lib, vocab_size=V, max_num_token=16, device=device)
    staged = run_steps(proc, sampler, make_states(CONFIGS, SOURCES), False, 2, 40)
    fused = run_steps(proc, sampler, make_states(CONFIGS, SOURCES), True, 2, 40)
    for a, b in zip(staged, fused, strict=True):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        assert a.top_logprobs == b.top_logprobs


def test_draft_rows_give_the_staged_tokens(proc, sampler) -> None:
    """Rows of draft chains (sharing their sequence's random stream) draw exactly as in the staged path."""
    drafts = [[4, 8, 15], None, [16]]
    configs = [GenerationConfig(seed=1, top_p=0.9), GenerationConfig(temperature=0.0), GenerationConfig(seed=3)]
    results = []
    for fused in (False, True):
        states = [RequestState([1, 2], c) for c in configs]
        logits = (np.random.default_rng(9).standard_normal((7, V)) * 3).astype(np.float32)
        batch = proc.batch(states, draft_trees=drafts)
        proc.inplace_update_logits(logits, batch)
        if fused:
            results.append(sampler.sample_from_logits(logits, batch))
        else:
            results.append(sampler.sample(sampler.renormalize(proc.compute_probs_from_logits(logits, batch), batch),
                                          batch))
    np.testing.assert_array_equal(results[0].token_ids, results[1].token_ids)
